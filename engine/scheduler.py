"""Scheduler: continuous batching over a token budget, chunked prefill, preemption by
recompute, and adapter admission (the adapter cache decides what fits on the device).
Pure Python.

Each step gives the running sequences their tokens first (preempting the newest when KV
blocks run out); then, unless that preempted one, it admits waiting requests.

Admission under a binding adapter cap:
- before admitting, the step tells the cache the waiting queue (``look_ahead``: reads and
  device loads start before a request reaches the head, eviction knows each adapter's next
  use);
- a sequence's adapter here is its ``lora_id``: an activated LoRA never invoked needs none
  (it runs the base model throughout), so it takes no slot and waits for none;
- waiting requests whose adapter is on the device (or that need none) are admitted first,
  in arrival order, then the others, in arrival order;
- fairness: a waiting request whose adapter is in host memory counts a step each time a
  request that arrived after it is admitted before it (``waiting_steps``). Once it has been
  overtaken ``starvation_steps`` times its adapter starves: until it starts, no other
  adapter takes new room on the device, and the running adapters whose room it needs
  (fewest running requests first) admit no new requests. So a request whose adapter is in
  host memory waits at most K = starvation_steps + the steps left to the longest running
  request (its remaining prompt chunks and new tokens: at most max_model_len) steps.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


class AdapterSlots(Protocol):
    """What the scheduler needs of the AdapterCache."""

    def acquire(self, adapter_id: int) -> bool:
        """Pin the adapter in a device slot for one more running sequence; False if it is
        not resident yet (a load is started) or no slot can be freed now."""

    def release(self, adapter_id: int) -> None:
        """One running sequence of the adapter stopped running."""

    def ready(self, adapter_id: int) -> bool:
        """Read from disk already: all it may lack is a slot."""

    def on_device(self, adapter_id: int) -> bool:
        """Resident on the device now."""

    def look_ahead(self, queue: list[int], place: bool = True) -> None:
        """The waiting requests' adapter ids, in queue order: start loads (onto the device
        too, with ``place``), plan eviction."""

    def drain_for(self, adapter_id: int, running: list[int]) -> set[int]:
        """The fewest of the ``running`` adapters (in that order) that must stop admitting
        for ``adapter_id`` to fit once their requests end."""


@dataclass
class ScheduledBatch:
    """Work of one step. Invariant: every entry's blocks are allocated for its tokens."""

    entries: list[tuple[Sequence, int]]  # (sequence, number of new tokens to compute)
    num_tokens: int
    preempted: list[Sequence]
    # seq_id -> choices 1..n-1 of a sequence whose prompt completes in this step: they
    # sample from its logits row (set by the engine before the step runs)
    forks: dict[str, list[Sequence]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.entries


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        adapters: AdapterSlots | None = None,
        starvation_steps: int = 16,
    ):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.adapters = adapters
        self.starvation_steps = starvation_steps
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival order: the last is preempted first

    # ---- queues -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish ``seq`` wherever it is and free its blocks and adapter pin at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.finish(reason)

    # ---- the step -----------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        entries: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, n, preempted):
                continue
            self.blocks.allocate(seq, n)
            entries.append((seq, n))
            budget -= n
        if not preempted:
            budget = self._admit_waiting(entries, budget)
        return ScheduledBatch(entries, self.max_num_batched_tokens - budget, preempted)

    def _make_room(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        """Preempt the newest running sequences until ``seq`` fits; False if ``seq`` itself
        had to go."""
        while not self.blocks.can_allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free_seq(seq)
        if seq.lora_id and self.adapters is not None:
            self.adapters.release(seq.lora_id)

    def _admit_waiting(self, entries: list[tuple[Sequence, int]], budget: int) -> int:
        running = Counter(s.lora_id for s in self.running if s.lora_id)
        starving = self._starving_adapter(running)
        if self.adapters is not None:  # no loads ahead onto the device while one starves
            self.adapters.look_ahead([s.lora_id for s in self.waiting],
                                     place=starving is None)
        allowed = self._admission_filter(running, starving)
        arrival = {id(seq): i for i, seq in enumerate(self.waiting)}
        last_admitted = -1
        order = sorted(self.waiting, key=lambda s: (starving is None or s.lora_id != starving,
                                                    not self._on_device(s)))
        seats = sum(s.seats for s in self.running)
        for seq in order:  # the starving adapter's, then those on the device, then the rest
            if budget == 0 or seats + seq.seats > self.max_num_seqs:
                break
            if not allowed(seq.lora_id):
                continue
            if seq.lora_id and not self.adapters.acquire(seq.lora_id):  # type: ignore[union-attr]
                continue
            if not self._start(seq, budget, entries):
                if seq.lora_id:
                    self.adapters.release(seq.lora_id)  # type: ignore[union-attr]
                break  # out of blocks: keep arrival order for the rest
            budget -= entries[-1][1]
            seats += seq.seats
            last_admitted = max(last_admitted, arrival[id(seq)])
        self._count_overtaken(last_admitted, arrival)
        return budget

    def _on_device(self, seq: Sequence) -> bool:
        return not seq.lora_id or self.adapters.on_device(seq.lora_id)  # type: ignore[union-attr]

    def _count_overtaken(self, last_admitted: int, arrival: dict[int, int]) -> None:
        """Waiting requests that a later arrival overtook this step, while their adapter was
        in host memory (or none was needed), count the step."""
        for seq in self.waiting:
            if arrival[id(seq)] > last_admitted:
                break
            if not seq.lora_id or self.adapters.ready(seq.lora_id):  # type: ignore[union-attr]
                seq.waiting_steps += 1
                seq.max_waiting_steps = max(seq.max_waiting_steps, seq.waiting_steps)

    def _start(self, seq: Sequence, budget: int, entries: list[tuple[Sequence, int]]) -> bool:
        self.blocks.match_prefix(seq)
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if not self.blocks.can_allocate(seq, n):
            self.blocks.free_seq(seq)
            return False
        self.blocks.allocate(seq, n)
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        seq.waiting_steps = 0
        self.running.append(seq)
        entries.append((seq, n))
        return True

    def _admission_filter(self, running: Counter, starving: int | None) -> Callable[[int], bool]:
        """Which adapters' waiting requests may start now. Normally all. While an adapter
        starves (see the module docstring), only it, the base model and the running
        adapters that need not give way for it."""
        if starving is None:
            return lambda adapter_id: True
        order = sorted(running, key=lambda a: (running[a], a))
        drain = self.adapters.drain_for(starving, order)  # type: ignore[union-attr]
        return lambda a: a in (0, starving) or (a in running and a not in drain)

    def _starving_adapter(self, running: Counter) -> int | None:
        """The adapter, not running now, of the oldest waiting sequence overtaken too often."""
        for seq in self.waiting:
            if (seq.lora_id and seq.lora_id not in running
                    and seq.waiting_steps >= self.starvation_steps):
                return seq.lora_id
        return None

    # ---- n choices ----------------------------------------------------------------------
    def fork(self, parent: Sequence, children: list[Sequence]) -> list[tuple[int, int]]:
        """``parent`` computed its prompt this step and samples for ``children`` too: they
        run from now on sharing its prompt's blocks (their seats were held by ``parent``
        since admission). A child no block is free for waits to recompute, as a preempted
        sequence does. Returns the KV block copies to make (copy on write)."""
        parent.forked = True
        copies = []
        for child in children:
            copy = self.blocks.fork(parent, child)
            if copy is None:
                child.status = SequenceStatus.WAITING
                self.waiting.appendleft(child)
                continue
            if copy[0] >= 0:
                copies.append(copy)
            if child.lora_id and self.adapters is not None:
                pinned = self.adapters.acquire(child.lora_id)
                assert pinned, "the parent's adapter is resident: its choices pin it"
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        return copies

    # ---- after the step -----------------------------------------------------------------
    def postprocess(self, batch: ScheduledBatch) -> None:
        """Advance progress; make newly full blocks findable by the prefix cache."""
        for seq, n in batch.entries:
            seq.num_computed_tokens += n
            self.blocks.register_full_blocks(seq)
