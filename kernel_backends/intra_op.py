"""Intra-op threads: one thread of the process, the engine's, runs torch's parallel work.

Why: torch's OpenMP runtime (libgomp) gives every thread that starts a parallel region a
pool of worker threads of its own, kept until that thread exits, and counts the workers of
all pools. Once they outnumber the CPUs it cuts the workers' spin-wait from ~300,000 spins
(a few ms) to 1,000, so from then on every parallel region *in the whole process* wakes its
workers through the kernel (futex) instead of finding them spinning. A decode step is
hundreds of small parallel ops, so one adapter read on a loader thread (or an engine built
on one thread and stepped on another) slowed every later step, and any plain torch code in
the process, by 15-35 % (benchmarks/results/2026-12-02-omp-pools.md).

The rule, on every thread but the one that steps the engine:
- helper threads that run torch ops (adapter loaders) start with ``serial_thread`` and
  never start a parallel region;
- code that may run on any thread (an adapter read handed to ``asyncio.to_thread``) runs
  inside ``serial()``;
- the server builds its engine on the engine thread (``AsyncEngine.build``).

``openmp_workers()`` counts the threads Python did not start (OpenMP workers among them);
``tests/test_intra_op.py`` asserts that loads and serving add none.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)

_OMP_LIBS = ("libgomp", "libomp", "libiomp")


def _find_openmp() -> ctypes.CDLL | None:
    """torch's OpenMP runtime, as loaded in this process (None: torch runs without one, or
    this platform does not show its mappings)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(_OMP_LIBS):
            try:
                lib = ctypes.CDLL(path)
                lib.omp_get_max_threads.restype = ctypes.c_int
                lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                return lib
            except (OSError, AttributeError):
                continue
    return None


torch.get_num_threads()  # torch loads its runtime on first use
_omp = _find_openmp()


def thread_parallelism() -> int:
    """How many threads a torch op started on this thread may use."""
    return torch.get_num_threads()


def _set_thread_parallelism(n: int) -> None:
    # torch initialises each thread's OpenMP setting on its first parallel op (from the
    # process-wide torch.set_num_threads); get_num_threads triggers that first, so the value
    # set here is not overwritten later. torch.set_num_threads itself would change the
    # setting every new thread starts with, the engine's included.
    torch.get_num_threads()
    if _omp is not None:
        _omp.omp_set_num_threads(n)


@contextmanager
def serial() -> Iterator[None]:
    """Torch ops inside run on the calling thread alone (no OpenMP pool is started for
    it); the thread's setting is restored afterwards."""
    before = thread_parallelism()
    _set_thread_parallelism(1)
    try:
        yield
    finally:
        _set_thread_parallelism(before)


def serial_thread() -> None:
    """A thread initializer (``ThreadPoolExecutor(initializer=...)``): this thread's torch
    ops never start an OpenMP pool."""
    _set_thread_parallelism(1)


def openmp_workers() -> int:
    """OS threads of this process that Python did not start: OpenMP workers, and the
    threads of native libraries (gRPC, tokenizers) that exist from their start."""
    try:
        os_threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return 0
    return os_threads - threading.active_count()


def available() -> bool:
    """Whether this process's OpenMP runtime was found (so ``serial`` takes effect)."""
    return _omp is not None
