"""Which packed layout serves the CPU backend's float32 linears on this CPU: the panel GEMM
(csrc/panel_gemm.cpp) or oneDNN's packed layout. The rule it informs is
``kernels/cpu/packed_linear.GEMM_LAYOUT``, keyed by ``isa.cpu_isa()``.

    python -m loraplex.bench.gemm_layout [--rows 1 8 32 128 512] [--rounds 5]

SmolLM2-135M's linears (30 layers: qkv, o, gate_up, down) plus the logits head, every layer
with weights of its own, so weights come cold from memory as in serving. The two layouts
are timed alternately, round by round, in one process; the table gives the best round of
each and the ratio (> 1: panels faster).
"""

from __future__ import annotations

import argparse
import time

import torch

from ..kernels.cpu.isa import cpu_isa
from ..kernels.cpu.packed_linear import GEMM_LAYOUT, PackedLinear
from .common import machine_line

HIDDEN, INTER, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # [out, in]


def build(layout: str, seed: int = 0) -> tuple[list[list[PackedLinear]], PackedLinear]:
    g = torch.Generator().manual_seed(seed)
    layers = [[PackedLinear(torch.randn(o, i, generator=g) / i**0.5, None, layout)
               for o, i in SHAPES] for _ in range(LAYERS)]
    head = PackedLinear(torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN**0.5, None, layout)
    return layers, head


def run(layers: list[list[PackedLinear]], head: PackedLinear, rows: int) -> float:
    """Seconds for every layer's four linears on ``rows`` rows, plus the head."""
    xs = {i: torch.randn(rows, i) for i in (HIDDEN, INTER)}
    start = time.perf_counter()
    for linears in layers:
        for lin in linears:
            lin(xs[lin.in_features])
    head(xs[HIDDEN])
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    models = {layout: build(layout) for layout in ("panels", "onednn")}
    for layers, head in models.values():  # oneDNN builds a primitive per row count
        for rows in args.rows:
            run(layers, head, rows)
    print(machine_line("cpu", "float32"))
    print(f"SmolLM2 linears x {LAYERS} layers + head, cold weights, best of {args.rounds}; "
          f"GEMM_LAYOUT[{cpu_isa()!r}] = {GEMM_LAYOUT.get(cpu_isa(), 'onednn (unlisted)')!r}")
    print("| rows | panels ms | oneDNN ms | oneDNN / panels |")
    print("|---|---|---|---|")
    for rows in args.rows:
        best = {layout: float("inf") for layout in models}
        for _ in range(args.rounds):
            for layout, (layers, head) in models.items():
                best[layout] = min(best[layout], run(layers, head, rows))
        print(f"| {rows} | {best['panels'] * 1e3:.1f} | {best['onednn'] * 1e3:.1f} | "
              f"{best['onednn'] / best['panels']:.2f} |")


if __name__ == "__main__":
    main()
