"""EarlyReads: adapter reads started on any thread as a request arrives, before the engine
thread has seen the request (``AdapterCache.prefetch``), so that the read overlaps the step
in progress.

Invariants: at most ``limit`` reads wait to be adopted at once, one per adapter id; each is
taken once, by the engine thread (``adopt``), or dropped (``drop``): a dropped read still
finishes on its loader thread and its result is discarded. The lock guards the table
only; the reads themselves run on the cache's loader threads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .cached_adapter import CachedAdapter


class EarlyReads:
    def __init__(self, limit: int):
        self.limit = limit
        # adapter id -> (its adapter, the read, when it started)
        self._reads: dict[int, tuple[CachedAdapter, Future[Any], float]] = {}
        self._lock = threading.Lock()

    def start(self, a: CachedAdapter, submit: Callable[[], Future[Any]]) -> None:
        """Any thread: ``submit()`` a read for ``a`` unless one waits already or ``limit``
        do."""
        with self._lock:
            if a.adapter_id not in self._reads and len(self._reads) < self.limit:
                self._reads[a.adapter_id] = (a, submit(), time.monotonic())

    def adopt(self, adapter_id: int) -> Future[Any] | None:
        """Engine thread: take the adapter's waiting read, if any."""
        with self._lock:
            early = self._reads.pop(adapter_id, None)
        return None if early is None else early[1]

    def drop(self, stale: Callable[[CachedAdapter], bool], ttl_s: float) -> None:
        """Engine thread: forget the reads of the adapters ``stale`` names and those no
        request adopted within ``ttl_s`` seconds (a request refused before it was queued)."""
        now = time.monotonic()
        with self._lock:
            for adapter_id, (a, _, started) in list(self._reads.items()):
                if stale(a) or now - started > ttl_s:
                    del self._reads[adapter_id]

    def __iter__(self) -> Iterator[int]:
        with self._lock:
            return iter(list(self._reads))

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._reads
