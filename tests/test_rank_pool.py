"""RankPool: runs of units, first fit, compaction; and the AdapterCache on top of it:
rank-true placement, eviction by next use, loads ahead of the queue within the readers and
the host tier."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from loraplex.lora.cache import AdapterCache
from loraplex.lora.rank_pool import RankPool


def test_first_fit_free_and_compaction_moves_runs_left_in_order():
    pool = RankPool(num_units=10, rank_unit=1)
    a, b, c = pool.allocate(3), pool.allocate(2), pool.allocate(4)
    assert (a, b, c) == (0, 3, 5) and pool.free_units == 1
    pool.free(a)
    assert pool.allocate(4) is None  # 4 free units, but no hole of 4
    moves = pool.compact()
    assert [(m.src, m.dst, m.units) for m in moves] == [(3, 0, 2), (5, 2, 4)]
    assert pool.allocate(4) == 6
    pool.check()


def test_units_round_up_to_the_rank_unit():
    pool = RankPool(num_units=8, rank_unit=8)
    assert [pool.units_for(r) for r in (1, 8, 9, 16, 64)] == [1, 1, 2, 2, 8]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), max_size=40))
def test_books_hold_under_any_sequence_of_allocations_frees_and_compactions(ops):
    pool, live = RankPool(num_units=16, rank_unit=1), []
    for free_one, units in ops:
        if free_one and live:
            pool.free(live.pop(units % len(live)))
        elif (first := pool.allocate(units)) is not None:
            live.append(first)
        elif pool.free_units >= units:
            moved = {m.src: m.dst for m in pool.compact()}
            live = [moved.get(f, f) for f in live]
            assert pool.allocate(units) is not None
            live.append(max(pool.runs))
        pool.check()
        assert sorted(live) == sorted(pool.runs)


@dataclass
class Meta:
    path: Path
    rank: int
    name: str = ""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj"])
    size_bytes: int = 0


class Device:
    """The cache's device callbacks, recording what they were asked to do."""

    def __init__(self):
        self.loaded: dict[int, str] = {}
        self.moves: list[tuple[int, int, int]] = []

    def load(self, slot: int, weights: Meta) -> None:
        self.loaded[slot] = weights.path.name

    def clear(self, slot: int) -> None:
        self.loaded.pop(slot, None)

    def move(self, src: int, dst: int, rows: int) -> None:
        self.moves.append((src, dst, rows))
        self.loaded[dst] = self.loaded.pop(src)


def make_cache(units: int, max_loras: int, max_cpu: int, ranks: dict[str, int],
               reads: int = 4, gate: threading.Event | None = None):
    device = Device()

    def read(meta: Meta) -> Meta:
        if gate is not None:
            gate.wait(5)
        return meta

    cache = AdapterCache(max_loras, max_cpu, RankPool(units, 1), read, device.load,
                         device.clear, device.move, max_concurrent_reads=reads)
    ids = {name: cache.register(name, Meta(Path(name), r, name)).adapter_id
           for name, r in ranks.items()}
    return cache, device, ids


def resident_now(cache: AdapterCache, ids: dict[str, int], name: str) -> bool:
    """A request arrives and acquires, letting the read from disk it starts finish first."""
    cache.request_started(ids[name])
    for _ in range(3):
        if cache.acquire(ids[name]):
            return True
        cache.wait_for_loads(5)
    return False


def test_a_rank_8_adapter_takes_8_rows_and_mixed_ranks_share_the_pool():
    cache, _, ids = make_cache(units=24, max_loras=8, max_cpu=8,
                                    ranks={"r8": 8, "r4": 4, "r12": 12, "r16": 16})
    for name in ("r8", "r4", "r12"):
        assert resident_now(cache, ids, name)
    assert cache.pool.used_units == 24 and cache.pool.runs == {0: 8, 8: 4, 12: 12}
    assert not resident_now(cache, ids, "r16")  # all three run: nothing may go
    cache.release(ids["r4"])
    cache.release(ids["r12"])
    assert resident_now(cache, ids, "r16")  # evicts r4 and r12 (idle), keeps r8 (running)
    cache.check()


def test_scattered_free_units_are_compacted_between_steps():
    cache, device, ids = make_cache(units=12, max_loras=8, max_cpu=8,
                                    ranks={"a": 4, "b": 4, "c": 4, "d": 8})
    for name in ("a", "b", "c"):
        assert resident_now(cache, ids, name)
    for name in ("a", "c"):
        cache.release(ids[name])
    cache.look_ahead([ids["b"], ids["a"]])  # c is needed by nobody, a soon: c goes first
    assert resident_now(cache, ids, "d")  # needs 8: a and c go, b (running) moves left
    assert device.moves == [(4, 0, 4)] and cache.slot_of(ids["b"]) == 0
    assert cache.slot_of(ids["d"]) == 4 and cache.counts["compactions"] == 1
    cache.check()


def test_eviction_takes_the_adapter_needed_last():
    cache, _, ids = make_cache(units=8, max_loras=2, max_cpu=8,
                               ranks={"a": 4, "b": 4, "c": 4})
    for name in ("a", "b"):
        assert resident_now(cache, ids, name)
        cache.release(ids[name])
    cache.look_ahead([ids["c"], ids["a"], ids["b"]], place=False)  # b's next use is last
    assert resident_now(cache, ids, "c")
    assert cache.on_device(ids["a"]) and not cache.on_device(ids["b"])


def test_look_ahead_reads_within_the_readers_and_the_host_tier():
    gate = threading.Event()
    names = {f"a{i}": 2 for i in range(10)}
    cache, _, ids = make_cache(units=8, max_loras=4, max_cpu=3, ranks=names, reads=2,
                               gate=gate)
    for name in names:  # registration kept no weights: every adapter is on disk
        assert cache.state_of(cache.names[name]) == "ON_DISK"
    queue = [ids[f"a{i}"] for i in range(10)]
    cache.look_ahead(queue)
    loading = [n for n, a in cache.names.items() if cache.host.reading(a)]
    assert loading == ["a0", "a1"]  # two readers, nearest the head first
    gate.set()
    for _ in range(6):
        cache.wait_for_loads(5)
        cache.look_ahead(queue)
        cache.check()  # never more than max_cpu_loras in host memory
    held = sorted(n for n, a in cache.names.items() if cache.host.weights(a) is not None)
    assert held == ["a0", "a1", "a2"] and cache.counts["loads_host"] == 3
    assert sum(cache.on_device(ids[n]) for n in held) == 3  # copied ahead onto the device


def test_a_read_started_on_arrival_is_adopted_by_the_request(monkeypatch):
    gate = threading.Event()
    cache, _, ids = make_cache(units=8, max_loras=4, max_cpu=3,
                               ranks={"a": 2, "b": 2, "c": 2, "d": 2}, reads=2, gate=gate)
    for name in ("a", "b", "c", "ghost"):  # any thread, before the engine sees the request
        cache.prefetch(name)
    assert sorted(cache.host.early) == [ids["a"], ids["b"]]  # unknown names and the bound
    cache.request_started(ids["a"])  # the engine thread takes the read in flight
    assert cache.host.reading(cache.names["a"]) and ids["a"] not in cache.host.early
    gate.set()
    cache.wait_for_loads(5)
    assert cache.acquire(ids["a"]) and cache.counts["loads_host"] == 1
    cache.prefetch("a")  # held: nothing to read
    assert ids["a"] not in cache.host.early
    monkeypatch.setattr("loraplex.lora.host_tier.EARLY_READ_TTL_S", 0.0)
    cache.look_ahead([])  # b's request never came (refused before it was queued): dropped
    assert list(cache.host.early) == [] and cache.host.weights(cache.names["b"]) is None
    cache.check()


def test_drain_for_names_the_fewest_running_adapters_that_make_room():
    cache, _, ids = make_cache(units=8, max_loras=4, max_cpu=8,
                               ranks={"a": 4, "b": 2, "c": 2, "d": 6})
    for name in ("a", "b", "c"):
        assert resident_now(cache, ids, name)
    cache.wait_for_loads(5)
    cache.look_ahead([ids["d"]], place=False)
    assert cache.drain_for(ids["d"], [ids["b"], ids["c"], ids["a"]]) == {ids["b"], ids["c"],
                                                                            ids["a"]}
    cache.release(ids["a"])  # a idle now: its 4 units and b's 2 make 6
    assert cache.drain_for(ids["d"], [ids["b"], ids["c"]]) == {ids["b"]}


@pytest.mark.parametrize("bad", [0, -1])
def test_a_pool_needs_units(bad):
    with pytest.raises(ValueError, match="units"):
        RankPool(bad, 1)
