"""The batch-invariant bf16 linear on AMX: the AMX tile GEMM ("amx_tiles",
csrc/amx_gemm_bf16.cpp) against oneDNN at a fixed row count ("onednn_fixed", the former
invariant layout) and plain oneDNN ("onednn", not batch-invariant), one linear at a time.

    python -m loraplex.benchmarks.amx_gemm_micro [--rows 1 8 32 128 512 2048] [--rounds 5] [--threads N]
    python -m loraplex.benchmarks.amx_gemm_micro --engine [--rounds 3] [--threads N]

Per shape ([out, in]: SmolLM2-135M's qkv, o, k/v, gate_up, gate, down, and two larger
ones) and row count: microseconds of each layout's fastest call, warm weights (one linear,
called repeatedly), the layouts alternating round by round in the order A B C C B A; the table
gives each layout's best round and its ratio to amx_tiles (> 1: amx_tiles faster).

``--engine``: three bf16 engines in one process on SmolLM2-135M, engine_throughput's
requests (32 x 128 prompt, greedy): batch invariance off (oneDNN), on with "onednn_fixed"
(LORAPLEX_GEMM_LAYOUT, the former layout) and on with "amx_tiles"; output tok/s of a
prefill (1 new token) and of the whole run (64 new tokens), alternating A B C C B A, best
round of each (other processes on the machine only ever slow a round down).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from ..kernel_backends.cpu.packed_linear import PackedLinear
from .common import machine_line

SHAPES = [(960, 576), (576, 576), (192, 576), (3072, 576), (1536, 576), (576, 1536),
          (2048, 2048), (8192, 2048)]  # [out, in]
LAYOUTS = ("amx_tiles", "onednn_fixed", "onednn")


def per_call(linear: PackedLinear, x: torch.Tensor, budget_s: float = 0.02) -> float:
    """Seconds of the fastest of as many calls as fit ``budget_s`` (at least 5): the other
    helpers on the machine preempt threads for whole time slices, which a mean would count."""
    linear(x)
    best, calls, start = float("inf"), 0, time.perf_counter()
    while calls < 5 or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        linear(x)
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return best


ENGINES = {"off": ("off", None), "on_onednn_fixed": ("on", "onednn_fixed"),
           "on_amx_tiles": ("on", "amx_tiles")}


def engine_ab(rounds: int) -> None:
    from .. import LLMEngine, SamplingParams
    from ..engine.engine_config import EngineConfig
    from .common import default_model_dir, random_prompts

    model_dir = default_model_dir()
    prompts = random_prompts(32, 128, vocab=49152, seed=1)
    engines = {}
    for name, (mode, layout) in ENGINES.items():
        if layout:
            os.environ["LORAPLEX_GEMM_LAYOUT"] = layout
        engines[name] = LLMEngine.from_config(EngineConfig(
            model=str(model_dir), dtype="bfloat16", max_num_seqs=32, max_model_len=1024,
            batch_invariant=mode, enable_prefix_caching=False))
        os.environ.pop("LORAPLEX_GEMM_LAYOUT", None)
        engines[name].generate(prompts[:2], SamplingParams(temperature=0.0, max_new_tokens=2))
    print(machine_line("cpu", "bfloat16"), f"load average {os.getloadavg()}")
    print(f"engines in one process, 32 x 128 prompt, best of {rounds} rounds (A B C C B A)")
    print("| run | " + " | ".join(f"{n} tok/s" for n in engines)
          + " | off / on_onednn_fixed | off / on_amx_tiles |")
    print("|---" * (3 + len(engines)) + "|")
    for label, new in (("prefill (1 new token)", 1), ("64 new tokens", 64)):
        params = SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True)
        best = dict.fromkeys(engines, 0.0)
        for r in range(rounds):
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                start = time.perf_counter()
                outs = engines[name].generate(prompts, params)
                tps = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
                best[name] = max(best[name], tps)
        print(f"| {label} | " + " | ".join(f"{best[n]:.1f}" for n in engines)
              + f" | {best['off'] / best['on_onednn_fixed']:.2f}"
              + f" | {best['off'] / best['on_amx_tiles']:.2f} |", flush=True)
    print(f"load average {os.getloadavg()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", type=int, nargs="+", default=None,
                    help="out in out in ...: the shapes measured (default: SHAPES)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: as is)")
    ap.add_argument("--engine", action="store_true", help="three engines, not linears alone")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.engine:
        engine_ab(args.rounds)
        return
    shapes = (list(zip(args.shapes[::2], args.shapes[1::2], strict=True)) if args.shapes
              else SHAPES)
    print(machine_line("cpu", "bfloat16"), f"load average {os.getloadavg()}")
    print(f"warm weights, us a call, best of {args.rounds} rounds (A B C C B A)")
    print("| out x in | rows | " + " | ".join(LAYOUTS)
          + " | onednn_fixed / amx_tiles | onednn / amx_tiles |")
    print("|---" * (4 + len(LAYOUTS)) + "|")
    g = torch.Generator().manual_seed(0)
    for out_f, in_f in shapes:
        weight = (torch.randn(out_f, in_f, generator=g) / in_f**0.5).bfloat16()
        linears = {lay: PackedLinear(weight, None, lay) for lay in LAYOUTS}
        for rows in args.rows:
            x = torch.randn(rows, in_f, generator=g).bfloat16()
            best = {lay: float("inf") for lay in LAYOUTS}
            for r in range(args.rounds):
                order = LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]
                for lay in order:
                    best[lay] = min(best[lay], per_call(linears[lay], x))
            a = best["amx_tiles"]
            print(f"| {out_f} x {in_f} | {rows} | "
                  + " | ".join(f"{best[lay] * 1e6:.0f}" for lay in LAYOUTS)
                  + f" | {best['onednn_fixed'] / a:.2f} | {best['onednn'] / a:.2f} |",
                  flush=True)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
