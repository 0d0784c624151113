"""CompileJob: one constraint's compile from admission to its grammar (or error), shared by
every request that waits for the same constraint; and the lanes a job may run in."""

from __future__ import annotations

import concurrent.futures
import enum
from dataclasses import dataclass, field

from .constraint import StructuredOutputs


class Lane(enum.Enum):
    """FAST: a constraint whose source is small, run first by the worker kept for them, for a
    short budget (past it the job moves to SLOW); SLOW: everything else, on the general
    workers, for the full time limit. General workers take FAST jobs too when idle."""

    FAST = "fast"
    SLOW = "slow"


class State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"  # its future holds the grammar or the error
    DROPPED = "dropped"  # every waiter left before it finished; a running one was killed


@dataclass(eq=False)
class CompileJob:
    constraint: StructuredOutputs
    key: tuple
    lane: Lane
    source_bytes: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    waiters: int = 1  # requests awaiting it; 0 drops it (while not DONE)
    state: State = State.QUEUED
    grammar_bytes: int = 0  # the compiled grammar's memory (its cache cost), once DONE

    @property
    def in_flight(self) -> bool:
        return self.state in (State.QUEUED, State.RUNNING)

    def wanted(self) -> bool:
        """Whether its worker should go on (read without the lock: one attribute)."""
        return self.state is State.RUNNING
