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


class EarlyReads:
    def __init__(self, limit: int):
        self.limit = limit
        self._reads: dict[int, tuple[Future, float]] = {}  # adapter id -> (read, started)
        self._lock = threading.Lock()

    def start(self, adapter_id: int, submit: Callable[[], Future]) -> None:
        """Any thread: ``submit()`` a read for ``adapter_id`` unless one waits already or
        ``limit`` do."""
        with self._lock:
            if adapter_id not in self._reads and len(self._reads) < self.limit:
                self._reads[adapter_id] = (submit(), time.monotonic())

    def adopt(self, adapter_id: int) -> Future | None:
        """Engine thread: take the adapter's waiting read, if any."""
        with self._lock:
            early = self._reads.pop(adapter_id, None)
        return None if early is None else early[0]

    def drop(self, stale: Callable[[int], bool], ttl_s: float) -> None:
        """Engine thread: forget the reads ``stale(adapter_id)`` names and those no request
        adopted within ``ttl_s`` seconds (a request refused before it was queued)."""
        now = time.monotonic()
        with self._lock:
            for adapter_id, (_, started) in list(self._reads.items()):
                if stale(adapter_id) or now - started > ttl_s:
                    del self._reads[adapter_id]

    def __iter__(self) -> Iterator[int]:
        with self._lock:
            return iter(list(self._reads))

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._reads
