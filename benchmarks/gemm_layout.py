"""Which packed layout serves the CPU backend's float32 (bfloat16) linears on this CPU: the
panel GEMM (csrc/panel_gemm.cpp; csrc/panel_gemm_bf16.cpp) or oneDNN's packed layout. The
rules it informs are ``kernel_backends/cpu/packed_linear.GEMM_LAYOUT`` (BF16_GEMM_LAYOUT),
keyed by ``isa.cpu_isa()``.

    python -m loraplex.benchmarks.gemm_layout [--rows 1 8 32 128 512] [--rounds 5]
        [--dtype float32|bfloat16] [--layouts panels onednn onednn_fixed]
    python -m loraplex.benchmarks.gemm_layout --engine [--rounds 5]

Linears alone: SmolLM2-135M's (30 layers: qkv, o, gate_up, down) plus the logits head,
every layer with weights of its own, so weights come cold from memory as in serving.
``--engine``: the whole engine, two engines in one process (one per layout) on the same
requests (32 x 64 prompt x 32 new tokens, base model and 32 distinct rank-8 adapters).
Either way the two layouts run alternately, round by round; the table gives the best
round of each and the ratio (> 1: panels faster). ``--layouts`` picks the layouts of the
linears-alone table (the first is the one the others are divided by); onednn_fixed is
``--batch-invariant``'s candidate (packed_linear.INVARIANT_GEMM_LAYOUT).
"""

from __future__ import annotations

import argparse
import time

import torch

from ..kernel_backends.cpu.isa import cpu_isa
from ..kernel_backends.cpu.packed_linear import BF16_GEMM_LAYOUT, GEMM_LAYOUT, LAYOUTS, PackedLinear
from .common import machine_line

HIDDEN, INTER, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # [out, in]


def build(layout: str, dtype: torch.dtype = torch.float32,
          seed: int = 0) -> tuple[list[list[PackedLinear]], PackedLinear]:
    g = torch.Generator().manual_seed(seed)
    layers = [[PackedLinear((torch.randn(o, i, generator=g) / i**0.5).to(dtype), None, layout)
               for o, i in SHAPES] for _ in range(LAYERS)]
    head = PackedLinear((torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype),
                        None, layout)
    return layers, head


def run(layers: list[list[PackedLinear]], head: PackedLinear, rows: int) -> float:
    """Seconds for every layer's four linears on ``rows`` rows, plus the head."""
    dtype = head.panels.dtype if head.panels is not None else head.packed.dtype
    xs = {i: torch.randn(rows, i).to(dtype) for i in (HIDDEN, INTER)}
    start = time.perf_counter()
    for linears in layers:
        for lin in linears:
            lin(xs[lin.in_features])
    head(xs[HIDDEN])
    return time.perf_counter() - start


def engine_ab(rounds: int) -> None:
    """Output tok/s of the engine with each layout, alternating, best round of each."""
    import os
    import tempfile
    from pathlib import Path

    from .. import LLMEngine, SamplingParams
    from ..engine.engine_config import EngineConfig
    from .common import default_model_dir, make_random_adapters, random_prompts

    model_dir = default_model_dir()
    adapters = make_random_adapters(model_dir, 32, Path(tempfile.gettempdir())
                                    / "loraplex-bench-adapters")
    prompts = random_prompts(32, 64, vocab=49152, seed=2)
    engines = {}
    for layout in ("panels", "onednn"):
        os.environ["LORAPLEX_GEMM_LAYOUT"] = layout
        # float32: GEMM_LAYOUT is the float32 table (bf16 has its own, --dtype above);
        # every request in one batch, every adapter on the device, the adapters' rank, no
        # prefix cache (rounds repeat their prompts); else the engine's defaults
        engines[layout] = LLMEngine.from_config(EngineConfig(
            model=str(model_dir), dtype="float32", max_num_seqs=32, max_model_len=1024,
            max_lora_rank=8, max_loras=32, max_cpu_loras=32, enable_prefix_caching=False,
            lora_modules={n: str(p) for n, p in adapters.items()}))
    del os.environ["LORAPLEX_GEMM_LAYOUT"]
    params = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    print(machine_line("cpu", "float32"))
    print(f"engine, 32 x 64 prompt x 32 new tokens, best of {rounds}; "
          f"GEMM_LAYOUT[{cpu_isa()!r}] = {GEMM_LAYOUT.get(cpu_isa(), 'onednn (unlisted)')!r}")
    print("| requests | panels tok/s | oneDNN tok/s | panels / oneDNN |")
    print("|---|---|---|---|")
    for label, names in (("base model", [None] * 32), ("32 adapters", list(adapters))):
        best = dict.fromkeys(engines, 0.0)
        for _ in range(rounds):
            for layout, engine in engines.items():
                start = time.perf_counter()
                outs = engine.generate(prompts, params, adapters=names)
                tps = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
                best[layout] = max(best[layout], tps)
        print(f"| {label} | {best['panels']:.1f} | {best['onednn']:.1f} | "
              f"{best['panels'] / best['onednn']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engine", action="store_true", help="whole engine, not linears alone")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="linears alone: the weights' and inputs' dtype")
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["panels", "onednn"],
                    help="linears alone: the layouts compared (ratios to the first)")
    args = ap.parse_args()
    if args.engine:
        engine_ab(args.rounds)
        return
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    name, rules = (("GEMM_LAYOUT", GEMM_LAYOUT) if dtype == torch.float32
                   else ("BF16_GEMM_LAYOUT", BF16_GEMM_LAYOUT))
    models = {layout: build(layout, dtype) for layout in args.layouts}
    for layers, head in models.values():  # oneDNN builds a primitive per row count
        for rows in args.rows:
            run(layers, head, rows)
    print(machine_line("cpu", args.dtype))
    print(f"SmolLM2 linears x {LAYERS} layers + head, cold weights, best of {args.rounds}; "
          f"{name}[{cpu_isa()!r}] = {rules.get(cpu_isa(), 'onednn (unlisted)')!r}")
    first = args.layouts[0]
    others = args.layouts[1:]
    print("| rows | " + " | ".join(f"{lay} ms" for lay in args.layouts)
          + "".join(f" | {lay} / {first}" for lay in others) + " |")
    print("|---" * (1 + len(args.layouts) + len(others)) + "|")
    for rows in args.rows:
        best = {layout: float("inf") for layout in models}
        for _ in range(args.rounds):
            for layout, (layers, head) in models.items():
                best[layout] = min(best[layout], run(layers, head, rows))
        print(f"| {rows} | " + " | ".join(f"{best[lay] * 1e3:.1f}" for lay in args.layouts)
              + "".join(f" | {best[lay] / best[first]:.2f}" for lay in others) + " |")

if __name__ == "__main__":
    main()
