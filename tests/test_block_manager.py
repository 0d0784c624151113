"""BlockManager and Scheduler bookkeeping, pure Python."""

from __future__ import annotations

from loraplex.engine.block_manager import BlockManager
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler
from loraplex.engine.sequence import Sequence


def seq(rid: str, tokens: list[int], adapter_id: int = 0, max_new: int = 4) -> Sequence:
    return Sequence(rid, tokens, SamplingParams(temperature=0, max_new_tokens=max_new),
                    adapter_id=adapter_id, max_tokens=len(tokens) + max_new)


def compute_all(bm: BlockManager, s: Sequence) -> None:
    bm.match_prefix(s)
    n = s.num_tokens - s.num_computed_tokens
    bm.allocate(s, n)
    s.num_computed_tokens += n
    bm.register_full_blocks(s)


def test_shared_prefix_hits_and_refcounts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", list(range(10)))
    compute_all(bm, a)
    b = seq("b", list(range(8)) + [99, 98])
    bm.match_prefix(b)
    assert b.num_computed_tokens == 8 and b.block_table == a.block_table[:2]
    assert bm.ref_counts[a.block_table[0]] == 2
    bm.free_seq(a)
    assert bm.ref_counts[b.block_table[0]] == 1
    bm.free_seq(b)
    assert bm.num_used_blocks == 0


def test_other_adapter_never_shares_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    compute_all(bm, seq("a", list(range(10)), adapter_id=1))
    for adapter_id in (0, 2):
        other = seq(f"o{adapter_id}", list(range(10)), adapter_id=adapter_id)
        bm.match_prefix(other)
        assert other.num_computed_tokens == 0 and not other.block_table


def test_at_least_one_token_is_left_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    compute_all(bm, seq("a", list(range(8))))
    again = seq("b", list(range(8)))
    bm.match_prefix(again)
    assert again.num_computed_tokens == 4  # the last full block is recomputed for its logits


def test_freed_cached_blocks_are_reused_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", list(range(8)))
    compute_all(bm, a)
    cached = list(a.block_table)
    bm.free_seq(a)
    assert bm.num_used_blocks == 0 and len(bm.cached) == 2
    fresh = seq("c", [50 + i for i in range(12)])
    bm.allocate(fresh, 12)  # takes the 2 never-used blocks, then the tail block of "a"
    assert cached[1] in fresh.block_table and cached[0] not in fresh.block_table
    again = seq("d", list(range(8)) + [1])
    bm.match_prefix(again)
    assert again.block_table == [cached[0]]  # block 0 survived, block 1 was evicted


def test_a_steady_load_reuses_the_blocks_it_freed():
    """Plain freed blocks go out again most recently freed first: a steady load keeps to the
    blocks it needs instead of walking the whole pool (which commits every page of the KV
    budget and writes into memory long out of the CPU's caches)."""
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    seen: set[int] = set()
    for i in range(20):
        s = seq(f"r{i}", [i] * 10)
        compute_all(bm, s)
        seen.update(s.block_table)
        bm.free_seq(s)
    assert seen == {0, 1, 2}


def test_plain_blocks_go_out_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", list(range(8)))
    compute_all(bm, a)
    blocks = list(a.block_table)
    bm.free_seq(a)  # two full blocks: cached
    for i in range(6):  # one partial block each: plain
        s = seq(f"p{i}", [100 + i, 1, 2])
        compute_all(bm, s)
        bm.free_seq(s)
    again = seq("b", list(range(8)) + [1])
    bm.match_prefix(again)
    assert again.block_table == blocks  # the cached prefix outlived the plain traffic
    bm.check([again])


def step(sched: Scheduler) -> list[tuple[str, int]]:
    """One scheduler step; sequences that finished their tokens 'sample' token 7."""
    batch = sched.schedule()
    sched.postprocess(batch)
    for s, _ in batch.entries:
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(7)
    return [(s.request_id, n) for s, n in batch.entries]


def test_scheduler_chunks_limits_and_preempts_newest():
    bm = BlockManager(num_blocks=3, block_size=4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=6)
    seqs = [seq(f"r{i}", [10 * i + j for j in range(4)], max_new=8) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert step(sched) == [("r0", 4), ("r1", 2)]  # r1's prompt is chunked; r2 over max_num_seqs
    assert step(sched) == [("r0", 1), ("r1", 2)]  # r0 takes the last free block
    assert step(sched) == [("r0", 1)]  # r1 needs a block: it is the newest, so it is preempted
    assert seqs[1].num_preemptions == 1 and seqs[1].block_table == []
    assert list(sched.waiting)[:2] == [seqs[1], seqs[2]]  # preempted work goes first
    sched.finish(seqs[0], "abort")
    assert bm.num_used_blocks == 0


class FakeSlots:
    """AdapterSlots with ``capacity`` slots: an adapter holds one while it has runners."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.runners: dict[int, int] = {}
        self.on_disk: set[int] = set()  # adapters still being read from disk

    def acquire(self, adapter_id: int) -> bool:
        if adapter_id in self.on_disk:
            return False
        if adapter_id not in self.runners and len(self.runners) >= self.capacity:
            return False
        self.runners[adapter_id] = self.runners.get(adapter_id, 0) + 1
        return True

    def release(self, adapter_id: int) -> None:
        self.runners[adapter_id] -= 1
        if self.runners[adapter_id] == 0:
            del self.runners[adapter_id]

    def ready(self, adapter_id: int) -> bool:
        return adapter_id not in self.on_disk

    def on_device(self, adapter_id: int) -> bool:
        return adapter_id in self.runners

    def look_ahead(self, queue: list[int], place: bool = True) -> None:
        pass

    def drain_for(self, adapter_id: int, running: list[int]) -> set[int]:
        """One slot per adapter: the first running one gives way when all slots are held."""
        return set(running[:1]) if len(self.runners) >= self.capacity else set()


def run_with_traffic(starvation_steps: int, steps: int) -> tuple[Scheduler, Sequence, list]:
    """Two slots held by adapters 1 and 2, which get a new request every step; adapter 3
    waits for a slot. Requests finish 3 steps after they start."""
    slots = FakeSlots(2)
    sched = Scheduler(BlockManager(num_blocks=400, block_size=4), max_num_seqs=64,
                      max_num_batched_tokens=256, adapters=slots,
                      starvation_steps=starvation_steps)
    sched.add(seq("hot1-0", [1, 2], adapter_id=1))
    sched.add(seq("hot2-0", [1, 2], adapter_id=2))
    cold = seq("cold", [1, 2], adapter_id=3)
    sched.add(cold)
    admitted_hot = []
    for i in range(steps):
        for s in [s for s in sched.running if s.num_output_tokens >= 3]:
            sched.finish(s, "length")
        sched.add(seq(f"hot1-{i + 1}", [1, 2], adapter_id=1))
        sched.add(seq(f"hot2-{i + 1}", [1, 2], adapter_id=2))
        waiting = {s.request_id for s in sched.waiting if s.adapter_id in (1, 2)}
        step(sched)
        admitted_hot += [s.request_id for s in sched.running if s.request_id in waiting]
    return sched, cold, admitted_hot


def test_starving_adapter_gets_a_slot_in_bounded_time():
    _, cold, _ = run_with_traffic(starvation_steps=4, steps=12)
    assert cold.num_output_tokens > 0, "adapter 3 never got a slot under steady traffic"


def test_without_the_guard_steady_traffic_would_starve_it():
    _, cold, _ = run_with_traffic(starvation_steps=10_000, steps=12)
    assert cold.num_output_tokens == 0  # the guard, not luck, is what lets it in


def test_requests_of_other_running_adapters_keep_flowing_while_one_starves():
    _, _, admitted = run_with_traffic(starvation_steps=4, steps=8)
    late = [r for r in admitted if int(r.split("-")[1]) >= 5]  # admitted after starvation began
    assert late, "every running adapter was held back while adapter 3 starved"


def test_waiting_on_the_disk_is_not_starving():
    """Passed-over steps count toward starvation only once the adapter is read: a slow read
    must not make it 'starving' and hold every other adapter back the moment it lands."""
    slots = FakeSlots(2)
    slots.on_disk.add(3)  # an adapter on disk cannot take a slot yet
    sched = Scheduler(BlockManager(num_blocks=100, block_size=4), max_num_seqs=8,
                      max_num_batched_tokens=64, adapters=slots, starvation_steps=2)
    slow = seq("slow", [1, 2], adapter_id=3)
    sched.add(slow)
    for _ in range(5):
        step(sched)
    assert slow.waiting_steps == 0 and slow in sched.waiting
    slots.on_disk.clear()
    step(sched)
    assert slow in sched.running
