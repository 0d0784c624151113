"""DeviceTier: which adapters hold a run of the device's rank-row pool (``RankPool``), and
how one gets a run: evicting idle adapters, compacting the pool. Bookkeeping and the
device callbacks only; the engine thread calls it, between steps.

Invariants (``check``): the resident adapters are the pool's runs, at most ``max_loras``
of them, each run ``units_for(rank)`` long; the run of an adapter with a running sequence
is never taken (compaction may move it).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from .cached_adapter import NEVER, CachedAdapter, eviction_order
from .rank_pool import RankPool


class DeviceTier:
    def __init__(
        self,
        max_loras: int,
        pool: RankPool,
        load_slot: Callable[[int, Any], None],  # copy weights into the run at a slot
        clear_slot: Callable[[int], None],
        move_slot: Callable[[int, int, int], None] | None,  # (src, dst, rank rows)
        counts: Counter[str],  # the cache's: loads_device, load_device_seconds, compactions
        clock: itertools.count,  # the cache's: stamps last_used
    ):
        self.max_loras = max_loras
        self.pool = pool
        self._load_slot = load_slot
        self._clear_slot = clear_slot
        self._move_slot = move_slot
        self.counts = counts
        self._clock = clock
        self.resident: dict[int, CachedAdapter] = {}  # slot (first unit of a run) -> adapter

    def place(self, a: CachedAdapter, next_use: dict[int, int],
              evict_for: int | None = None) -> bool:
        """Give ``a`` (held in host memory) a run, evicting idle adapters (and compacting
        the pool) as needed; with ``evict_for`` (a queue position: a load ahead of need)
        only adapters whose next use comes after it may go. False, changing nothing, when
        it cannot."""
        units = self.pool.units_for(a.rank)
        victims = self.victims(next_use, evict_for)
        spare_units = self.pool.free_units + sum(self.pool.runs[v.slot] for v in victims)
        if units > spare_units or len(self.resident) - len(victims) >= self.max_loras:
            return False
        while len(self.resident) >= self.max_loras or self.pool.free_units < units:
            self.evict(victims.pop(self._best_victim(victims, units)))
        first = self.pool.allocate(units)
        if first is None:  # enough free units, but scattered
            self._compact()
            first = self.pool.allocate(units)
        assert first is not None, "the free units were counted, so a compacted pool fits"
        self._write(first, a)
        self.resident[first], a.slot = a, first
        a.last_used = next(self._clock)
        return True

    def victims(self, next_use: dict[int, int], evict_for: int | None = None
                ) -> list[CachedAdapter]:
        """Idle unpinned resident adapters in eviction order; with ``evict_for`` only those
        whose next use comes after that queue position."""
        idle = [a for a in self.resident.values() if a.running == 0 and not a.pinned]
        if evict_for is not None:
            idle = [a for a in idle if next_use.get(a.adapter_id, NEVER) > evict_for]
        return eviction_order(idle, next_use)

    def drain_for(self, a: CachedAdapter, running: list[CachedAdapter],
                  next_use: dict[int, int]) -> set[int]:
        """The fewest of the ``running`` adapters, taken in that order, whose runs (once
        their requests end) with the free and idle ones make room for ``a``."""
        if a.slot is not None:
            return set()
        idle = self.victims(next_use)
        have = self.pool.free_units + sum(self.pool.runs[v.slot] for v in idle)
        count_room = self.max_loras - len(self.resident) + len(idle)
        need, drain = self.pool.units_for(a.rank), set()
        for b in running:
            if have >= need and count_room >= 1:
                break
            if b.slot is not None and not b.pinned:
                drain.add(b.adapter_id)
                have += self.pool.runs[b.slot]
                count_room += 1
        return drain

    def hand_over(self, old: CachedAdapter, new: CachedAdapter) -> bool:
        """Write ``new``'s weights (held in host memory) into ``old``'s run and give it the
        run, when ``old`` (idle) is resident, ``new`` is not, and both need as many units:
        an in-place swap, with no allocation and no compaction. False, changing nothing,
        otherwise."""
        slot = old.slot
        if (slot is None or new.slot is not None or old.running
                or self.pool.units_for(old.rank) != self.pool.units_for(new.rank)):
            return False
        self._write(slot, new)
        old.slot = None
        self.resident[slot], new.slot = new, slot
        new.last_used = next(self._clock)
        return True

    def _write(self, slot: int, a: CachedAdapter) -> None:
        start = time.perf_counter()
        self._load_slot(slot, a.weights)
        self.counts["loads_device"] += 1
        self.counts["load_device_seconds"] += time.perf_counter() - start

    def evict(self, a: CachedAdapter) -> None:
        if a.slot is not None:
            self._clear_slot(a.slot)
            self.pool.free(a.slot)
            del self.resident[a.slot]
            a.slot = None

    def _best_victim(self, victims: list[CachedAdapter], units: int) -> int:
        """The first victim (in eviction order) whose run, freed, leaves a hole that fits
        ``units``, so that no compaction is needed; else the first."""
        for i, v in enumerate(victims):
            if self.pool.hole_if_freed(v.slot) >= units:  # type: ignore[arg-type]
                return i
        return 0

    def _compact(self) -> None:
        """Slide every run to the left (between steps: no kernel reads the pool now)."""
        if self._move_slot is None:
            raise RuntimeError("the pool is fragmented and this cache cannot move runs")
        for mv in self.pool.compact():
            a = self.resident.pop(mv.src)
            self._move_slot(mv.src, mv.dst, mv.units * self.pool.rank_unit)
            self.resident[mv.dst], a.slot = a, mv.dst
        self.counts["compactions"] += 1

    @property
    def in_use(self) -> int:
        """Resident adapters pinned by a running sequence."""
        return sum(1 for a in self.resident.values() if a.running > 0)

    def check(self) -> None:
        self.pool.check()
        assert set(self.pool.runs) == set(self.resident), "device runs != resident adapters"
        assert len(self.resident) <= self.max_loras, f"{len(self.resident)} on the device"
        for slot, a in self.resident.items():
            assert a.slot == slot and a.weights is not None, f"{a.name}: bad device state"
            assert self.pool.runs[slot] == self.pool.units_for(a.rank), f"{a.name}: run size"
