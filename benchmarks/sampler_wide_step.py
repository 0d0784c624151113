"""What a step widened by an adapter's own tokenizer costs the sampler: one call on
[rows, vocab] float32 logits (every row greedy with logprobs=1), plain, against the same
rows 2 columns wider with half of them on the adapter's vocabulary (``vocab_rows``: the
padding, the finiteness read before it, no one-read argmax fast path).

    .venv/bin/python -m loraplex.benchmarks.sampler_wide_step [--vocab 32000] [--rows 32]

Both in one process, alternating in both orders (A B, B A, three times); the best of each
reported with their ratio, the ISA, dtype, backend and the load average.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
from loraplex.engine.sampler import Sampler
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence
from loraplex.kernel_backends import select_backend


def _timed(fn: Callable[[], object], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    kernels = select_backend(torch.device("cpu"), torch.float32)
    sampler = Sampler(0, kernels)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, logprobs=1)
    seqs = [Sequence(f"r{i}", [1, 2, 3], params, logprobs=[]) for i in range(args.rows)]
    base = torch.randn(args.rows, args.vocab)
    extra = torch.randn(args.rows, 2)
    vocab_rows = [args.vocab + 2 if i % 2 else args.vocab for i in range(args.rows)]

    def plain() -> object:
        return sampler(base.clone(), seqs)

    def wide() -> object:
        return sampler(torch.cat([base, extra], 1), seqs, None, vocab_rows)

    for _ in range(5):
        plain(), wide()
    best = {"plain": float("inf"), "wide": float("inf")}
    for first, second in [(plain, wide), (wide, plain)] * 3:
        for fn in (first, second):
            best[fn.__name__] = min(best[fn.__name__], _timed(fn, args.reps))
    flags = Path("/proc/cpuinfo").read_text()
    isa = "AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other"
    print(f"sampler, vocab {args.vocab}, {args.rows} rows, float32, {kernels.name} backend, "
          f"{isa}: plain {best['plain']:.0f} us, wide {best['wide']:.0f} us per call, "
          f"wide / plain {best['wide'] / best['plain']:.2f}; load average "
          f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}")


if __name__ == "__main__":
    main()
