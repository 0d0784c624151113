"""DeviceTier: which adapters hold a run of the device's rank-row pool (``RankPool``), and
how one gets a run: evicting idle adapters, compacting the pool. Bookkeeping and the
device callbacks only; the engine thread calls it, between steps.

State it owns: ``resident`` (slot -> adapter) and ``slots`` (its inverse), its LRU stamps,
``loads`` and ``compactions``; the adapter records are the cache's, read here, never
written.

Invariants (``check``): the resident adapters are the pool's runs, at most ``max_loras``
of them, each run ``units_for(rank)`` long; the run of an adapter with a running sequence
is never taken (compaction may move it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from .cached_adapter import NEVER, CachedAdapter, eviction_order
from .rank_pool import RankPool

if TYPE_CHECKING:
    from .peft_format import LoRAWeights


class DeviceTier:
    def __init__(
        self,
        max_loras: int,
        pool: RankPool,
        load_slot: Callable[[int, LoRAWeights], None],  # copy weights into the run at a slot
        clear_slot: Callable[[int], None],
        move_slot: Callable[[int, int, int], None] | None,  # (src, dst, rank rows)
    ):
        self.max_loras = max_loras
        self.pool = pool
        self._load_slot = load_slot
        self._clear_slot = clear_slot
        self._move_slot = move_slot
        self.resident: dict[int, CachedAdapter] = {}  # slot (first unit of a run) -> adapter
        self.slots: dict[CachedAdapter, int] = {}  # adapter -> its slot
        self.used: dict[CachedAdapter, int] = {}  # LRU stamps of the resident adapters
        self._clock = itertools.count(1)
        self.loads = 0  # weights written into a run
        self.compactions = 0

    def slot(self, a: CachedAdapter) -> int | None:
        return self.slots.get(a)

    def touch(self, a: CachedAdapter) -> None:
        """``a`` was used: the last to go among adapters needed alike."""
        if a in self.slots:
            self.used[a] = next(self._clock)

    def place(self, a: CachedAdapter, weights: LoRAWeights, next_use: dict[int, int],
              evict_for: int | None = None) -> bool:
        """Give ``a`` a run holding ``weights`` (its host copy), evicting idle adapters (and
        compacting the pool) as needed; with ``evict_for`` (a queue position: a load ahead
        of need) only adapters whose next use comes after it may go. False, changing
        nothing, when it cannot."""
        units = self.pool.units_for(a.rank)
        victims = self.victims(next_use, evict_for)
        spare_units = self.pool.free_units + sum(self.pool.runs[self.slots[v]] for v in victims)
        if units > spare_units or len(self.resident) - len(victims) >= self.max_loras:
            return False
        while len(self.resident) >= self.max_loras or self.pool.free_units < units:
            self.evict(victims.pop(self._best_victim(victims, units)))
        first = self.pool.allocate(units)
        if first is None:  # enough free units, but scattered
            self._compact()
            first = self.pool.allocate(units)
        assert first is not None, "the free units were counted, so a compacted pool fits"
        self._write(first, weights)
        self._seat(a, first)
        return True

    def victims(self, next_use: dict[int, int], evict_for: int | None = None
                ) -> list[CachedAdapter]:
        """Idle unpinned resident adapters in eviction order; with ``evict_for`` only those
        whose next use comes after that queue position."""
        idle = [a for a in self.resident.values() if a.running == 0 and not a.pinned]
        if evict_for is not None:
            idle = [a for a in idle if next_use.get(a.adapter_id, NEVER) > evict_for]
        return eviction_order(idle, next_use, self.used)

    def drain_for(self, a: CachedAdapter, running: list[CachedAdapter],
                  next_use: dict[int, int]) -> set[int]:
        """The fewest of the ``running`` adapters, taken in that order, whose runs (once
        their requests end) with the free and idle ones make room for ``a``."""
        if a in self.slots:
            return set()
        idle = self.victims(next_use)
        have = self.pool.free_units + sum(self.pool.runs[self.slots[v]] for v in idle)
        count_room = self.max_loras - len(self.resident) + len(idle)
        need, drain = self.pool.units_for(a.rank), set()
        for b in running:
            if have >= need and count_room >= 1:
                break
            slot = self.slots.get(b)
            if slot is not None and not b.pinned:
                drain.add(b.adapter_id)
                have += self.pool.runs[slot]
                count_room += 1
        return drain

    def hand_over(self, old: CachedAdapter, new: CachedAdapter, weights: LoRAWeights) -> bool:
        """Write ``new``'s ``weights`` (its host copy) into ``old``'s run and give it the
        run, when ``old`` (idle) is resident, ``new`` is not, and both need as many units:
        an in-place swap, with no allocation and no compaction. False, changing nothing,
        otherwise."""
        slot = self.slots.get(old)
        if (slot is None or new in self.slots or old.running
                or self.pool.units_for(old.rank) != self.pool.units_for(new.rank)):
            return False
        self._write(slot, weights)
        del self.slots[old], self.used[old]
        self._seat(new, slot)
        return True

    def _seat(self, a: CachedAdapter, slot: int) -> None:
        self.resident[slot], self.slots[a] = a, slot
        self.touch(a)

    def _write(self, slot: int, weights: LoRAWeights) -> None:
        self._load_slot(slot, weights)
        self.loads += 1

    def evict(self, a: CachedAdapter) -> None:
        slot = self.slots.pop(a, None)
        if slot is not None:
            self._clear_slot(slot)
            self.pool.free(slot)
            del self.resident[slot], self.used[a]

    def _best_victim(self, victims: list[CachedAdapter], units: int) -> int:
        """The first victim (in eviction order) whose run, freed, leaves a hole that fits
        ``units``, so that no compaction is needed; else the first."""
        for i, v in enumerate(victims):
            if self.pool.hole_if_freed(self.slots[v]) >= units:
                return i
        return 0

    def _compact(self) -> None:
        """Slide every run to the left (between steps: no kernel reads the pool now)."""
        if self._move_slot is None:
            raise RuntimeError("the pool is fragmented and this cache cannot move runs")
        for mv in self.pool.compact():
            a = self.resident.pop(mv.src)
            self._move_slot(mv.src, mv.dst, mv.units * self.pool.rank_unit)
            self.resident[mv.dst], self.slots[a] = a, mv.dst
        self.compactions += 1

    @property
    def in_use(self) -> int:
        """Resident adapters pinned by a running sequence."""
        return sum(1 for a in self.resident.values() if a.running > 0)

    def check(self) -> None:
        self.pool.check()
        assert set(self.pool.runs) == set(self.resident), "device runs != resident adapters"
        assert len(self.resident) <= self.max_loras, f"{len(self.resident)} on the device"
        assert {a: s for s, a in self.resident.items()} == self.slots, "slots != resident"
        assert self.used.keys() == self.slots.keys(), "LRU stamps != resident adapters"
        for slot, a in self.resident.items():
            assert self.pool.runs[slot] == self.pool.units_for(a.rank), f"{a.name}: run size"
