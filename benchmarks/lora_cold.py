"""The LoRA kernel with cold weights: a whole decode step's LoRA, per prefetch distance.

    .venv/bin/python -m loraplex.benchmarks.lora_cold [--tokens 32] [--prefetch 0,1,2]

``bench.lora_cpu`` times one layer over and over, its adapters hot in cache; in a decode
step every layer's adapters come from memory once (32 distinct rank-8 adapters of
SmolLM2-135M: 160 MB a step). This runs the ``kernel`` route over 30 layers x 4 wrapped
linears, each with its own pools (32 adapters, ``--ranks`` cycled), in order, and prints
ms per step (min and median of 7) for each ``prefetch`` distance of the kernel (work items
ahead; 0: none) beside 0's figure, with the ISA, dtype and backend, and the distance
``lora_routes.kernel_prefetch`` chooses on this ISA for the dtype.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..kernel_backends.cpu import extension, isa
from ..kernel_backends.cpu.cpu_lora_segments import CPULoRASegments
from ..kernel_backends.cpu.lora_routes import kernel_prefetch
from .lora_cpu import LAYERS, token_slots, weights

NUM_LAYERS = 30


def build(tokens: int, dtype: torch.dtype, ranks: list[int]) -> list[tuple]:
    """One (pools, segments, x, out) per wrapped linear of NUM_LAYERS layers."""
    contiguous = tokens > 32  # decode: interleaved slots; longer steps: sequences in order
    linears = []
    for _ in range(NUM_LAYERS):
        for din, outs in LAYERS.values():
            pools = weights(din, outs, dtype, ranks)
            seg = CPULoRASegments.from_token_slots(
                pools.token_slots(token_slots(tokens, 32, contiguous)), torch.device("cpu"))
            linears.append((pools, seg, torch.randn(tokens, din).to(dtype),
                            torch.zeros(tokens, sum(outs), dtype=dtype)))
    return linears


def step_ms(linears: list[tuple], prefetch: int) -> tuple[float, float]:
    ext = extension.load()

    def step() -> None:
        for p, seg, x, out in linears:
            ext.add_lora_gather(out, x, seg.lora_rows, seg.lora_row_slots, p.lora_a,
                                p.lora_b, p.ranks, prefetch)

    step()
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--ranks", default="8")
    parser.add_argument("--prefetch", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the distances")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    distances = [int(d) for d in args.prefetch.split(",")]
    print(f"ISA {isa.cpu_isa()}, backend cpu (kernel route), {args.threads} threads, "
          f"{args.tokens} tokens over 32 adapters of ranks {args.ranks}, {NUM_LAYERS} layers "
          f"x {len(LAYERS)} linears, cold")
    for name in args.dtypes.split(","):
        print(f"{name}: chosen prefetch here {kernel_prefetch(getattr(torch, name))}")
        linears = build(args.tokens, getattr(torch, name), [int(r) for r in
                                                            args.ranks.split(",")])
        for _ in range(args.rounds):
            base = None
            for d in distances:
                best, median = step_ms(linears, d)
                base = base or median
                print(f"{name:8s} prefetch {d}: {best:6.2f} ms min, {median:6.2f} median "
                      f"({median / base:.2f} of prefetch {distances[0]})", flush=True)


if __name__ == "__main__":
    main()
