"""RankPool: which units of the device rank-row pool each resident adapter owns.

The device holds every LoRA slice's weights in one pool of rank rows per slice, cut into
``num_units`` units of ``rank_unit`` rows (``KernelBackend.lora_pool``). A resident adapter
of rank r owns ``ceil(r / rank_unit)`` consecutive units, and its slot is its first unit:
a rank-8 adapter takes rank-8 memory, whatever ``max_lora_rank`` is.

Invariants (``check`` asserts them; the engine's debug mode runs it after every step):
- runs are disjoint, in bounds, and ``used_units`` is the sum of their lengths;
- a free unit belongs to no run.

Allocation is first fit. When the free units suffice but no hole is long enough,
``compact`` plans moves that slide every run to the left (in slot order), leaving one hole
at the end; the caller copies the rows, between steps, while no kernel reads them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Move:
    """Rows of the run at unit ``src`` (``units`` long) go to unit ``dst`` (dst < src)."""

    src: int
    dst: int
    units: int


class RankPool:
    def __init__(self, num_units: int, rank_unit: int):
        if num_units < 1 or rank_unit < 1:
            raise ValueError(f"a rank pool needs units: {num_units} units of {rank_unit} rows")
        self.num_units = num_units
        self.rank_unit = rank_unit
        self.runs: dict[int, int] = {}  # first unit (the slot) -> units

    def units_for(self, rank: int) -> int:
        return max(1, -(-rank // self.rank_unit))

    @property
    def used_units(self) -> int:
        return sum(self.runs.values())

    @property
    def free_units(self) -> int:
        return self.num_units - self.used_units

    def _holes(self) -> list[tuple[int, int]]:
        """(start, length) of every free stretch, left to right."""
        holes, at = [], 0
        for first in sorted(self.runs):
            if first > at:
                holes.append((at, first - at))
            at = first + self.runs[first]
        if at < self.num_units:
            holes.append((at, self.num_units - at))
        return holes

    def allocate(self, units: int) -> int | None:
        """The first unit of a new run of ``units``, or None when no hole is long enough."""
        for start, length in self._holes():
            if length >= units:
                self.runs[start] = units
                return start
        return None

    def hole_if_freed(self, first: int) -> int:
        """The length of the free stretch that freeing the run at ``first`` would leave."""
        end = first + self.runs[first]
        before = max((f + u for f, u in self.runs.items() if f + u <= first), default=0)
        after = min((f for f in self.runs if f >= end), default=self.num_units)
        return after - before

    def free(self, first: int) -> None:
        del self.runs[first]

    def compact(self) -> list[Move]:
        """Slide every run left, in slot order; returns the moves (apply them in order)."""
        moves, at = [], 0
        for first in sorted(self.runs):
            units = self.runs[first]
            if first != at:
                moves.append(Move(first, at, units))
                del self.runs[first]
                self.runs[at] = units
            at += units
        return moves

    def check(self) -> None:
        """Assert the invariants (debug mode: after every step)."""
        at = 0
        for first in sorted(self.runs):
            units = self.runs[first]
            assert first >= at, f"run at unit {first} overlaps the run before it (ends {at})"
            assert units >= 1, f"run at unit {first} is empty"
            at = first + units
        assert at <= self.num_units, f"a run ends at unit {at}, past the pool's {self.num_units}"
