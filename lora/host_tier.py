"""HostTier: adapters' weights in host memory, read from disk on loader threads.

State it owns: ``copies`` (the host copies), ``reads`` (reads from disk in flight),
``early`` (reads started before the engine thread saw their request), its LRU stamps and
``loads``; the adapter records are the cache's, read here, never written.

Invariants: at most ``max_cpu_loras`` adapters are held; at most ``max_concurrent_reads``
reads run at once, never on the engine step; an adapter is in at most one of ``copies``
and ``reads``; a read started early on any thread (``prefetch``) waits in ``early`` until
the engine thread adopts it; an adapter dropped from host memory leaves the device too
(``evict_device``: host ⊇ device). Everything but ``prefetch`` runs on the engine thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from ..kernel_backends.intra_op import serial_thread
from .cached_adapter import CachedAdapter, eviction_order
from .early_reads import EarlyReads

if TYPE_CHECKING:
    from .peft_format import AdapterMeta, LoRAWeights

EARLY_READ_TTL_S = 2.0  # an early read (``prefetch``) no request adopted by then is dropped


class HostTier:
    def __init__(
        self,
        max_cpu_loras: int,
        read: Callable[[AdapterMeta], LoRAWeights],  # raises on a bad adapter
        max_concurrent_reads: int,
        evict_device: Callable[[CachedAdapter], None],
    ):
        self.max_cpu_loras = max_cpu_loras
        self.max_concurrent_reads = max_concurrent_reads
        self._read = read
        self._evict_device = evict_device
        self.copies: dict[CachedAdapter, LoRAWeights] = {}
        self.reads: dict[CachedAdapter, Future[LoRAWeights]] = {}
        self.used: dict[CachedAdapter, int] = {}  # LRU stamps of the held adapters
        self._clock = itertools.count(1)
        self.loads = 0  # reads from disk taken into host memory
        # loader threads run torch ops serially: a pool of theirs would slow every step
        self._loader = ThreadPoolExecutor(max_concurrent_reads, initializer=serial_thread,
                                          thread_name_prefix="loraplex-adapter-loader")
        self.early = EarlyReads(max_concurrent_reads)  # ``prefetch``'s, not yet adopted

    # ---- what it holds ------------------------------------------------------------------
    def weights(self, a: CachedAdapter) -> LoRAWeights | None:
        return self.copies.get(a)

    @property
    def held_bytes(self) -> int:
        """Bytes of the host copies: each adapter's ``size_bytes`` (A, B, biases and its own
        embedding / head rows, whole tables included)."""
        return sum(w.size_bytes for w in self.copies.values())

    def reading(self, a: CachedAdapter) -> bool:
        return a in self.reads

    def ready(self, a: CachedAdapter) -> bool:
        """Held, or its read has finished (taken at the next ``collect``)."""
        read = self.reads.get(a)
        return a in self.copies or (read is not None and read.done())

    @property
    def held(self) -> int:
        return len(self.copies)

    def put(self, a: CachedAdapter, weights: LoRAWeights) -> None:
        """Hold ``weights`` (read already) for ``a``; ``trim`` makes the room."""
        self.reads.pop(a, None)
        self.copies[a] = weights
        self.touch(a)

    def touch(self, a: CachedAdapter) -> None:
        """``a`` was used: the last to go among adapters needed alike."""
        if a in self.copies:
            self.used[a] = next(self._clock)

    def drop(self, a: CachedAdapter) -> None:
        """Forget ``a`` (dropped by the cache): its copy, its read (which finishes on its
        loader thread, unread) and its early read. The device run goes first (caller)."""
        self.copies.pop(a, None)
        self.used.pop(a, None)
        self.reads.pop(a, None)
        self.early.adopt(a.adapter_id)

    # ---- reads --------------------------------------------------------------------------
    def needs_read(self, a: CachedAdapter) -> bool:
        return a not in self.copies and a not in self.reads and a.error is None

    def prefetch(self, a: CachedAdapter) -> None:
        """Any thread: start reading ``a`` now unless it needs no read or
        ``max_concurrent_reads`` early reads wait to be adopted."""
        if self.needs_read(a):
            self.early.start(a, lambda: self._submit(a))

    def adopt_early(self, a: CachedAdapter) -> bool:
        """Make ``a``'s early read (if any) its read."""
        read = self.early.adopt(a.adapter_id)
        if read is not None:
            self.reads[a] = read
        return read is not None

    def drop_stale_early(self) -> None:
        """Forget early reads of adapters gone (retired), held or read anew, and those no
        request adopted within ``EARLY_READ_TTL_S``."""
        self.early.drop(lambda a: a.retired or not self.needs_read(a), EARLY_READ_TTL_S)

    def begin_read(self, a: CachedAdapter) -> None:
        self.reads[a] = self._submit(a)

    def start_read(self, a: CachedAdapter, next_use: dict[int, int]) -> None:
        """Start reading ``a`` from disk (or adopt its early read) if it needs a read, a
        reader is free and the host tier has room."""
        if self.needs_read(a) and not self.adopt_early(a) and self.read_room(next_use):
            self.begin_read(a)

    def _submit(self, a: CachedAdapter) -> Future[LoRAWeights]:
        return self._loader.submit(self._read, a.meta)

    def read_room(self, next_use: dict[int, int]) -> int:
        """Reads that may start now: free readers, and room in the host tier counting the
        reads in flight and the adapters it could drop (those no waiting request needs)."""
        loading = len(self.reads)
        droppable = sum(1 for b in self.victims(None, next_use)
                        if b.adapter_id not in next_use)
        host_room = self.max_cpu_loras - self.held - loading + droppable
        return max(0, min(self.max_concurrent_reads - loading, host_room))

    def collect(self, a: CachedAdapter, next_use: dict[int, int]) -> str | None:
        """Take a loader thread's result, if it is ready and the host tier has room; start
        a read if ``a`` needs one. The error of a read that failed (the read is over)."""
        read = self.reads.get(a)
        if read is None:
            self.start_read(a, next_use)
            return None
        if not read.done():
            return None
        if read.exception() is None and not self._room_for(a, next_use):
            return None  # stays LOADING until an adapter in host memory can go
        del self.reads[a]
        try:
            weights = read.result()
        except Exception as e:  # noqa: BLE001 - a broken file on disk fails the adapter
            return f"reloading {a.meta.files.label()} failed: {e}"
        self.loads += 1
        self.put(a, weights)
        self.trim(a, next_use)
        return None

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until a read finishes; at once when none is in
        flight."""
        pending = list(self.reads.values())
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    # ---- room ---------------------------------------------------------------------------
    def _room_for(self, a: CachedAdapter, next_use: dict[int, int]) -> bool:
        return self.held < self.max_cpu_loras or bool(self.victims(a, next_use))

    def victims(self, keep: CachedAdapter | None, next_use: dict[int, int]
                ) -> list[CachedAdapter]:
        """Adapters host memory may drop (unpinned, not running), in eviction order."""
        spare = [b for b in self.copies if b is not keep and not b.pinned and b.running == 0]
        return eviction_order(spare, next_use, self.used)

    def trim(self, keep: CachedAdapter | None, next_use: dict[int, int]) -> None:
        """Keep at most ``max_cpu_loras`` adapters in host memory."""
        for b in self.victims(keep, next_use)[: max(0, self.held - self.max_cpu_loras)]:
            self._evict_device(b)
            del self.copies[b]
            del self.used[b]

    def check(self) -> None:
        assert self.held <= self.max_cpu_loras, f"{self.held} in host memory"
        assert self.used.keys() == self.copies.keys(), "LRU stamps != held adapters"
        assert not self.copies.keys() & self.reads.keys(), "held and read at once"

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
