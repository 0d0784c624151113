"""The mechanism behind the slowdown that serving adapters left behind, in plain torch.

    .venv/bin/python -m loraplex.benchmarks.omp_pools [--serial]

Times a decode-like loop of small parallel torch ops (30 linears of a batch of 32 rows,
each followed by an elementwise op), then runs one large op on each of two helper threads
that stay alive (as the adapter loader threads did), and times the loop again; then lets
the helpers exit and times it once more. With ``--serial`` the helpers start with
``kernel_backends.intra_op.serial_thread`` (the fix). Prints the best of 5 loops for each state,
and the OS threads of the process (OpenMP workers included).
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..kernel_backends import intra_op


def decode_like_loop(weights: list[torch.Tensor], x: torch.Tensor, steps: int = 300) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        y = x
        for w in weights:
            y = torch.nn.functional.linear(y, w) * 0.01 + x
    return time.perf_counter() - start


def best(weights: list[torch.Tensor], x: torch.Tensor) -> float:
    return min(decode_like_loop(weights, x) for _ in range(5))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serial", action="store_true", help="helpers run serial_thread first")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(576, 576, generator=gen) for _ in range(30)]
    x = torch.randn(32, 576, generator=gen)
    threads = lambda: len(os.listdir("/proc/self/task"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, helpers "
          f"{'serial (the fix)' if args.serial else 'plain'}")
    before = best(weights, x)
    print(f"before any helper:          {before:.2f} s   {threads()} OS threads")
    helpers = ThreadPoolExecutor(2, initializer=intra_op.serial_thread if args.serial else None)
    for f in [helpers.submit(lambda: torch.randn(1000, 1000).mul_(2).sum()) for _ in range(4)]:
        f.result()
    during = best(weights, x)
    print(f"helpers alive, idle:        {during:.2f} s   {threads()} OS threads   "
          f"({during / before:.2f}x)")
    helpers.shutdown(wait=True)
    time.sleep(0.5)
    after = best(weights, x)
    print(f"helpers gone:               {after:.2f} s   {threads()} OS threads   "
          f"({after / before:.2f}x)")


if __name__ == "__main__":
    main()
