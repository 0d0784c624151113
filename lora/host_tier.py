"""HostTier: adapters' weights in host memory, read from disk on loader threads.

Invariants: at most ``max_cpu_loras`` adapters are held (``weights`` set); at most
``max_concurrent_reads`` reads run at once, never on the engine step; a read started early
on any thread (``prefetch``) waits in ``early`` until the engine thread adopts it; an
adapter dropped from host memory leaves the device too (``evict_device``: host ⊇ device).
Everything but ``prefetch`` runs on the engine thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

from ..kernels.intra_op import serial_thread
from .cached_adapter import CachedAdapter, eviction_order
from .early_reads import EarlyReads

EARLY_READ_TTL_S = 2.0  # an early read (``prefetch``) no request adopted by then is dropped


class HostTier:
    def __init__(
        self,
        max_cpu_loras: int,
        read: Callable[[Any], Any],  # meta -> weights; raises on a bad adapter
        max_concurrent_reads: int,
        adapters: dict[int, CachedAdapter],  # the cache's, live and retired-but-busy
        next_use: dict[int, int],  # the cache's, updated in place by look_ahead
        counts: Counter[str],  # the cache's: loads_host, load_host_seconds
        clock: itertools.count,  # the cache's: stamps last_used
        evict_device: Callable[[CachedAdapter], None],
    ):
        self.max_cpu_loras = max_cpu_loras
        self.max_concurrent_reads = max_concurrent_reads
        self._read = read
        self._adapters = adapters
        self._next_use = next_use
        self.counts = counts
        self._clock = clock
        self._evict_device = evict_device
        self._timing_lock = threading.Lock()  # several loader threads add to counts
        # loader threads run torch ops serially: a pool of theirs would slow every step
        self._loader = ThreadPoolExecutor(max_concurrent_reads, initializer=serial_thread,
                                          thread_name_prefix="loraplex-adapter-loader")
        self.early = EarlyReads(max_concurrent_reads)  # ``prefetch``'s, not yet adopted

    # ---- reads --------------------------------------------------------------------------
    @staticmethod
    def needs_read(a: CachedAdapter) -> bool:
        return a.weights is None and a.loading is None and a.error is None

    def prefetch(self, a: CachedAdapter) -> None:
        """Any thread: start reading ``a`` now unless it needs no read or
        ``max_concurrent_reads`` early reads wait to be adopted."""
        if self.needs_read(a):
            self.early.start(a.adapter_id, lambda: self.submit(a))

    def adopt_early(self, a: CachedAdapter) -> bool:
        """Make ``a``'s early read (if any) its load."""
        read = self.early.adopt(a.adapter_id)
        if read is not None:
            a.loading = read
        return read is not None

    def drop_stale_early(self) -> None:
        """Forget early reads of adapters gone, held or read anew, and those no request
        adopted within ``EARLY_READ_TTL_S``."""
        def stale(adapter_id: int) -> bool:
            a = self._adapters.get(adapter_id)
            return a is None or a.retired or not self.needs_read(a)
        self.early.drop(stale, EARLY_READ_TTL_S)

    def start_read(self, a: CachedAdapter) -> None:
        """Start reading ``a`` from disk (or adopt its early read) if it needs a read, a
        reader is free and the host tier has room."""
        if self.needs_read(a) and not self.adopt_early(a) and self.read_room():
            a.loading = self.submit(a)

    def submit(self, a: CachedAdapter) -> Any:
        return self._loader.submit(self._timed_read, a.meta)

    def _timed_read(self, meta: Any) -> Any:
        start = time.perf_counter()
        weights = self._read(meta)
        with self._timing_lock:
            self.counts["load_host_seconds"] += time.perf_counter() - start
        return weights

    def read_room(self) -> int:
        """Reads that may start now: free readers, and room in the host tier counting the
        reads in flight and the adapters it could drop (those no waiting request needs)."""
        loading = sum(1 for b in self._adapters.values() if b.loading is not None)
        droppable = sum(1 for b in self.victims(None) if b.adapter_id not in self._next_use)
        host_room = self.max_cpu_loras - self.held - loading + droppable
        return max(0, min(self.max_concurrent_reads - loading, host_room))

    def collect(self, a: CachedAdapter) -> None:
        """Take a loader thread's result, if it is ready and the host tier has room; start
        a read if ``a`` needs one."""
        if a.loading is None or not a.loading.done():
            if a.loading is None:
                self.start_read(a)
            return
        if a.loading.exception() is None and not self._room_for(a):
            return  # stays LOADING until an adapter in host memory can go
        fut, a.loading = a.loading, None
        try:
            a.weights = fut.result()
        except Exception as e:  # noqa: BLE001 - a broken file on disk fails the adapter
            a.error = f"reloading {a.path} failed: {e}"
            return
        self.counts["loads_host"] += 1
        a.last_used = next(self._clock)
        self.trim(keep=a)

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until a read finishes; at once when none is in
        flight."""
        pending = [a.loading for a in self._adapters.values() if a.loading is not None]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    # ---- room ---------------------------------------------------------------------------
    @property
    def held(self) -> int:
        return sum(1 for a in self._adapters.values() if a.weights is not None)

    def _room_for(self, a: CachedAdapter) -> bool:
        return self.held < self.max_cpu_loras or bool(self.victims(a))

    def victims(self, keep: CachedAdapter | None) -> list[CachedAdapter]:
        """Adapters host memory may drop (unpinned, not running), in eviction order."""
        spare = [b for b in self._adapters.values() if b.weights is not None
                 and b is not keep and not b.pinned and b.running == 0]
        return eviction_order(spare, self._next_use)

    def trim(self, keep: CachedAdapter | None = None) -> None:
        """Keep at most ``max_cpu_loras`` adapters in host memory."""
        for b in self.victims(keep)[: max(0, self.held - self.max_cpu_loras)]:
            self._evict_device(b)
            b.weights = None

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
