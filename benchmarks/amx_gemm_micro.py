"""The batch-invariant bf16 linear on AMX: the AMX tile GEMM ("amx_tiles",
csrc/amx_gemm_bf16.cpp) against oneDNN at a fixed row count ("onednn_fixed", the former
invariant layout) and plain oneDNN ("onednn", not batch-invariant), one linear at a time.

    python -m loraplex.benchmarks.amx_gemm_micro [--rows 1 8 32 128 512 2048] [--rounds 5] [--threads N]

Per shape ([out, in]: SmolLM2-135M's qkv, o, k/v, gate_up, gate, down, and two larger
ones) and row count: microseconds of each layout's fastest call, warm weights (one linear,
called repeatedly), the layouts alternating round by round in the order A B C C B A; the table
gives each layout's best round and its ratio to amx_tiles (> 1: amx_tiles faster).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", type=int, nargs="+", default=None,
                    help="out in out in ...: the shapes measured (default: SHAPES)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
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
