"""AdapterCache: three tiers of adapters, all bookkeeping, no torch.

    disk (name -> path)  ->  host memory (max_cpu_loras)  ->  device pool (max_loras, units)

Registering an adapter costs its metadata; its weights are read when a request needs them.
On the device an adapter of rank r owns ``ceil(r / rank_unit)`` units of the rank-row pool
(``RankPool``), and at most ``max_loras`` adapters are resident.

Invariants (``check`` asserts them; the engine's debug mode runs it after every step):
- an adapter on the device is also held in host memory (host ⊇ device);
- at most ``max_cpu_loras`` adapters are held in host memory, at most ``max_loras`` on the
  device, and the device runs are the pool's runs;
- the run of an adapter with a running sequence (``running > 0``) is never taken (it may
  be moved, between steps, when the pool is compacted);
- eviction, from the device or from host memory, takes an unpinned idle adapter: first one
  no waiting request needs, then the one whose next use lies furthest back in the queue
  (``look_ahead``), then the least recently used;
- reading from disk happens on loader threads (at most ``max_concurrent_reads`` at once),
  never on the engine step; a read may start on any thread as a request arrives
  (``prefetch``), and the engine thread adopts it when the request reaches it;
- a name maps to one live adapter id; a replaced or removed adapter keeps its id, weights
  and run until its last request ends (``active == 0``), then is dropped.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import AdapterExistsError, AdapterNotFoundError
from .early_reads import EarlyReads
from .rank_pool import RankPool

_NEVER = 1 << 62  # the next use of an adapter no waiting request needs
EARLY_READ_TTL_S = 2.0  # an early read (``prefetch``) no request adopted by then is dropped
ON_DISK, LOADING, ON_CPU, ON_DEVICE, FAILED = "ON_DISK", "LOADING", "ON_CPU", "ON_DEVICE", "FAILED"


@dataclass
class AdapterInfo:
    """What ListAdapters reports of one adapter."""

    name: str
    path: str
    state: str  # ON_DISK | LOADING | ON_CPU | ON_DEVICE | FAILED
    rank: int
    target_modules: list[str]
    size_bytes: int
    active_requests: int
    pinned: bool
    preloaded: bool
    adapter_id: int = 0
    slot: int = -1
    error: str | None = None


@dataclass
class _Adapter:
    name: str
    path: Path
    adapter_id: int
    rank: int
    target_modules: list[str]
    size_bytes: int
    pinned: bool = False
    preloaded: bool = False
    meta: Any = None  # what registration validated (AdapterMeta): the loader reads by it
    weights: Any = None  # host copy (LoRAWeights) or None when only on disk
    loading: Future | None = None
    slot: int | None = None
    active: int = 0  # unfinished requests (waiting or running)
    running: int = 0  # running sequences: they pin the slot
    last_used: int = 0
    retired: bool = False  # unloaded or replaced: serves only its in-flight requests
    error: str | None = None

    @property
    def state(self) -> str:
        if self.error is not None:
            return FAILED
        if self.slot is not None:
            return ON_DEVICE
        if self.weights is not None:
            return ON_CPU
        return LOADING if self.loading is not None else ON_DISK


class AdapterCache:
    def __init__(
        self,
        max_loras: int,
        max_cpu_loras: int,
        pool: RankPool,
        read: Callable[[Any], Any],  # meta -> weights; raises on a bad adapter
        load_slot: Callable[[int, Any], None],  # copy weights into the run at a slot
        clear_slot: Callable[[int], None],
        move_slot: Callable[[int, int, int], None] | None = None,  # (src, dst, rank rows)
        max_concurrent_reads: int = 4,
        look_ahead_loads: int = 4,
    ):
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.pool = pool
        self._read = read
        self._load_slot = load_slot
        self._clear_slot = clear_slot
        self._move_slot = move_slot
        self.max_concurrent_reads = max_concurrent_reads
        self.look_ahead_loads = look_ahead_loads  # device loads started ahead, per step
        self.names: dict[str, _Adapter] = {}  # live registrations
        self.by_id: dict[int, _Adapter] = {}  # live and retired-but-busy adapters
        self.resident: dict[int, int] = {}  # slot (first unit of a run) -> adapter id
        self.next_use: dict[int, int] = {}  # adapter id -> queue position of its next request
        self.counts: Counter[str] = Counter()  # lookups_<tier>, loads_<tier>, compactions
        self._timing_lock = threading.Lock()
        self._ids = itertools.count(1)  # 0 is the base model
        self._clock = itertools.count(1)
        self._loader = ThreadPoolExecutor(max_concurrent_reads,
                                          thread_name_prefix="loraplex-adapter-loader")
        self._early = EarlyReads(max_concurrent_reads)  # ``prefetch``'s, not yet adopted

    # ---- registration (engine thread) ----------------------------------------------------
    def register(self, name: str, meta: Any, replace: bool = False, pin: bool = False,
                 preloaded: bool = False, weights: Any = None) -> AdapterInfo:
        """Register an adapter under ``name`` from its validated ``meta`` (``path``, ``rank``,
        ``target_modules``, ``size_bytes``); ``weights``, when already read, go to host
        memory. The old adapter, if replaced, finishes its in-flight requests on its own
        weights."""
        if not name:
            raise ValueError("adapter name must be non-empty")
        old = self.names.get(name)
        if old is not None and not replace:
            raise AdapterExistsError(f"adapter {name!r} already exists; pass replace to swap it")
        if pin and sum(a.pinned for a in self.names.values() if a is not old) >= self.max_loras:
            raise ValueError(f"at most max_loras={self.max_loras} adapters can be pinned")
        if old is not None:
            self._retire(old)
        a = _Adapter(name, Path(meta.path), next(self._ids), meta.rank,
                     list(meta.target_modules), meta.size_bytes, pin, preloaded, meta=meta,
                     weights=weights, last_used=next(self._clock))
        self.names[name] = self.by_id[a.adapter_id] = a
        if weights is not None:
            self._trim_host(keep=a)
        return self.info(a)

    def remove(self, name: str) -> None:
        """New requests get NOT_FOUND at once; in-flight ones finish first."""
        a = self.names.get(name)
        if a is None:
            raise AdapterNotFoundError(f"unknown adapter {name!r}; loaded: {sorted(self.names)}")
        self._retire(a)

    def _retire(self, a: _Adapter) -> None:
        del self.names[a.name]
        a.retired = True
        self._drop_if_idle(a)

    def _drop_if_idle(self, a: _Adapter) -> None:
        if a.retired and a.active == 0:
            self._evict_device(a)
            a.weights = None
            self.by_id.pop(a.adapter_id, None)
            self.next_use.pop(a.adapter_id, None)

    # ---- requests -----------------------------------------------------------------------
    def lookup(self, name: str) -> int:
        a = self.names.get(name)
        if a is None:
            raise AdapterNotFoundError(
                f"unknown adapter {name!r}; loaded adapters: {sorted(self.names) or 'none'}")
        if a.error is not None:
            raise AdapterNotFoundError(f"adapter {name!r} failed to load: {a.error}")
        return a.adapter_id

    def prefetch(self, name: str) -> None:
        """Any thread: start reading ``name`` from disk now, while its request is on its way
        to the engine thread (which adopts the read in ``request_started`` or
        ``look_ahead``), so that the read overlaps the step in progress. No-op when the
        adapter is unknown, held, being read, or ``max_concurrent_reads`` early reads are
        waiting to be adopted; one nobody adopts within ``EARLY_READ_TTL_S`` is dropped."""
        a = self.names.get(name)  # one dict read: safe beside the engine thread
        if a is None or a.weights is not None or a.loading is not None or a.error is not None:
            return
        self._early.start(a.adapter_id, lambda: self._loader.submit(self._timed_read, a.meta))

    def _adopt_early(self, a: _Adapter) -> bool:
        """Engine thread: make ``a``'s early read (if any) its load."""
        read = self._early.adopt(a.adapter_id)
        if read is not None:
            a.loading = read
        return read is not None

    def _early_is_stale(self, adapter_id: int) -> bool:
        """An early read of an adapter gone, held or being read anew."""
        a = self.by_id.get(adapter_id)
        return a is None or a.retired or a.weights is not None or a.loading is not None

    def request_started(self, adapter_id: int) -> None:
        """A request for the adapter arrived: counts where it found the adapter (the cache's
        hit rate per tier) and starts its read when a reader is free."""
        a = self.by_id[adapter_id]
        a.active += 1
        tier = "device" if a.slot is not None else "host" if a.weights is not None else "disk"
        self.counts[f"lookups_{tier}"] += 1
        if tier == "disk":
            self._maybe_start_loading(a)

    def request_done(self, adapter_id: int) -> None:
        a = self.by_id.get(adapter_id)
        if a is not None:
            a.active -= 1
            self._drop_if_idle(a)

    def failed(self, adapter_id: int) -> str | None:
        a = self.by_id.get(adapter_id)
        return None if a is None else a.error

    # ---- scheduler door -----------------------------------------------------------------
    def look_ahead(self, queue: list[int], place: bool = True) -> None:
        """``queue``: the adapter ids of the waiting requests, in queue order (repeats and
        0 allowed). Records each adapter's next use (eviction reads it), takes finished
        reads, starts reads for the adapters nearest the head (within the readers and the
        host tier), and, with ``place``, copies up to ``look_ahead_loads`` of the host-ready
        ones onto the device where that evicts nothing needed sooner. Engine thread, before
        a step."""
        self._early.drop(self._early_is_stale, EARLY_READ_TTL_S)
        self.next_use = {}
        for pos, adapter_id in enumerate(queue):
            if adapter_id and adapter_id in self.by_id:
                self.next_use.setdefault(adapter_id, pos)
        reads = self._read_room()
        device_loads = 0
        for adapter_id in self.next_use:  # dicts keep insertion order: nearest first
            a = self.by_id[adapter_id]
            if a.loading is not None:
                self._collect(a)
            if a.weights is None:
                if a.loading is None and a.error is None and not self._adopt_early(a) \
                        and reads > 0:
                    a.loading = self._loader.submit(self._timed_read, a.meta)
                    reads -= 1
            elif (place and a.slot is None and device_loads < self.look_ahead_loads
                  and self._place(a, evict_for=self.next_use[adapter_id])):
                device_loads += 1

    def _read_room(self) -> int:
        """Reads that may start now: free readers, and room in the host tier counting the
        reads in flight and the adapters it could drop (those no waiting request needs)."""
        loading = sum(1 for b in self.by_id.values() if b.loading is not None)
        held = sum(1 for b in self.by_id.values() if b.weights is not None)
        droppable = sum(1 for b in self._host_victims(None) if b.adapter_id not in self.next_use)
        host_room = self.max_cpu_loras - held - loading + droppable
        return max(0, min(self.max_concurrent_reads - loading, host_room))

    def acquire(self, adapter_id: int) -> bool:
        a = self.by_id[adapter_id]
        self._collect(a)
        if a.slot is None:
            if a.weights is None:
                return False  # on disk or loading: a loader thread is on it
            if not self._place(a):
                return False
        a.running += 1
        a.last_used = next(self._clock)
        return True

    def release(self, adapter_id: int) -> None:
        a = self.by_id[adapter_id]
        a.running -= 1
        a.last_used = next(self._clock)

    def ready(self, adapter_id: int) -> bool:
        """In host memory (or on the device): what it may still lack is room there."""
        a = self.by_id.get(adapter_id)
        return a is not None and (a.weights is not None
                                  or (a.loading is not None and a.loading.done()))

    def on_device(self, adapter_id: int) -> bool:
        a = self.by_id.get(adapter_id)
        return a is not None and a.slot is not None

    def drain_for(self, adapter_id: int, running: list[int]) -> set[int]:
        """The fewest of the ``running`` adapters, taken in that order, whose runs (once
        their requests end) with the free and idle ones make room for ``adapter_id``."""
        a = self.by_id[adapter_id]
        if a.slot is not None:
            return set()
        idle = self._victims(None)
        have = self.pool.free_units + sum(self.pool.runs[v.slot] for v in idle)
        count_room = self.max_loras - len(self.resident) + len(idle)
        need, drain = self.pool.units_for(a.rank), set()
        for other in running:
            if have >= need and count_room >= 1:
                break
            b = self.by_id[other]
            if b.slot is not None and not b.pinned:
                drain.add(other)
                have += self.pool.runs[b.slot]
                count_room += 1
        return drain

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until a read from disk finishes; return at once
        when none is in flight. The engine calls this when a step has nothing to run, so
        that it does not spin (holding the GIL) while the loader threads read."""
        pending = [a.loading for a in self.by_id.values() if a.loading is not None]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    def slot_of(self, adapter_id: int) -> int:
        return self.by_id[adapter_id].slot  # type: ignore[return-value]

    # ---- device tier --------------------------------------------------------------------
    def _place(self, a: _Adapter, evict_for: int | None = None) -> bool:
        """Give ``a`` a run on the device, evicting idle adapters (and compacting the pool)
        as needed; with ``evict_for`` (a queue position: a load ahead of need) only adapters
        whose next use comes after it may go. False, changing nothing, when it cannot."""
        units = self.pool.units_for(a.rank)
        victims = self._victims(evict_for)
        spare_units = self.pool.free_units + sum(self.pool.runs[v.slot] for v in victims)
        if units > spare_units or len(self.resident) - len(victims) >= self.max_loras:
            return False
        while len(self.resident) >= self.max_loras or self.pool.free_units < units:
            self._evict_device(victims.pop(self._best_victim(victims, units)))
        first = self.pool.allocate(units)
        if first is None:  # enough free units, but scattered
            self._compact()
            first = self.pool.allocate(units)
        assert first is not None, "the free units were counted, so a compacted pool fits"
        start = time.perf_counter()
        self._load_slot(first, a.weights)
        self.counts["loads_device"] += 1
        self.counts["load_device_seconds"] += time.perf_counter() - start
        self.resident[first], a.slot = a.adapter_id, first
        a.last_used = next(self._clock)
        return True

    def _victims(self, evict_for: int | None) -> list[_Adapter]:
        """Idle unpinned resident adapters, the first to evict first: none waiting for them,
        then the furthest next use, then the least recently used."""
        idle = [self.by_id[i] for i in self.resident.values()
                if self.by_id[i].running == 0 and not self.by_id[i].pinned]
        if evict_for is not None:
            idle = [v for v in idle if self.next_use.get(v.adapter_id, _NEVER) > evict_for]
        return sorted(idle, key=lambda v: (-self.next_use.get(v.adapter_id, _NEVER), v.last_used))

    def _best_victim(self, victims: list[_Adapter], units: int) -> int:
        """The first victim (in eviction order) whose run, freed, leaves a hole that fits
        ``units``, so that no compaction is needed; else the first."""
        for i, v in enumerate(victims):
            if self.pool.hole_if_freed(v.slot) >= units:  # type: ignore[arg-type]
                return i
        return 0

    def _evict_device(self, a: _Adapter) -> None:
        if a.slot is not None:
            self._clear_slot(a.slot)
            self.pool.free(a.slot)
            del self.resident[a.slot]
            a.slot = None

    def _compact(self) -> None:
        """Slide every run to the left (between steps: no kernel reads the pool now)."""
        if self._move_slot is None:
            raise RuntimeError("the pool is fragmented and this cache cannot move runs")
        for mv in self.pool.compact():
            adapter_id = self.resident.pop(mv.src)
            self._move_slot(mv.src, mv.dst, mv.units * self.pool.rank_unit)
            self.resident[mv.dst] = adapter_id
            self.by_id[adapter_id].slot = mv.dst
        self.counts["compactions"] += 1

    # ---- host tier ----------------------------------------------------------------------
    def _maybe_start_loading(self, a: _Adapter) -> None:
        """Start reading ``a`` from disk (or adopt its early read) if a reader is free and
        the host tier has room."""
        if a.loading is None and a.weights is None and a.error is None \
                and not self._adopt_early(a) and self._read_room():
            a.loading = self._loader.submit(self._timed_read, a.meta)

    def _timed_read(self, meta: Any) -> Any:
        start = time.perf_counter()
        weights = self._read(meta)
        with self._timing_lock:  # several loader threads
            self.counts["load_host_seconds"] += time.perf_counter() - start
        return weights

    def _collect(self, a: _Adapter) -> None:
        """Take a loader thread's result, if it is ready and the host tier has room."""
        if a.loading is None or not a.loading.done():
            if a.weights is None and a.loading is None and a.error is None:
                self._maybe_start_loading(a)
            return
        if a.loading.exception() is None and not self._host_room(a):
            return  # stays LOADING until an adapter in host memory can go
        fut, a.loading = a.loading, None
        try:
            a.weights = fut.result()
        except Exception as e:  # noqa: BLE001 - a broken file on disk fails the adapter
            a.error = f"reloading {a.path} failed: {e}"
            return
        self.counts["loads_host"] += 1
        a.last_used = next(self._clock)
        self._trim_host(keep=a)

    def _host_room(self, a: _Adapter) -> bool:
        held = sum(1 for b in self.by_id.values() if b.weights is not None)
        return held < self.max_cpu_loras or bool(self._host_victims(a))

    def _host_victims(self, keep: _Adapter | None) -> list[_Adapter]:
        """Adapters host memory may drop, the first to go first: unpinned and not running;
        then as ``_victims`` orders them."""
        spare = [b for b in self.by_id.values() if b.weights is not None and b is not keep
                 and not b.pinned and b.running == 0]
        return sorted(spare, key=lambda b: (-self.next_use.get(b.adapter_id, _NEVER),
                                            b.last_used))

    def _trim_host(self, keep: _Adapter | None = None) -> None:
        """Keep at most max_cpu_loras adapters in host memory. A victim on the device leaves
        the device too (host ⊇ device)."""
        held = sum(1 for b in self.by_id.values() if b.weights is not None)
        for b in self._host_victims(keep)[: max(0, held - self.max_cpu_loras)]:
            self._evict_device(b)
            b.weights = None

    # ---- reporting ----------------------------------------------------------------------
    def info(self, a: _Adapter) -> AdapterInfo:
        return AdapterInfo(a.name, str(a.path), a.state, a.rank, list(a.target_modules),
                           a.size_bytes, a.active, a.pinned, a.preloaded, a.adapter_id,
                           -1 if a.slot is None else a.slot, a.error)

    def list(self) -> list[AdapterInfo]:
        return [self.info(a) for a in sorted(self.names.values(), key=lambda a: a.name)]

    @property
    def slots_in_use(self) -> int:
        """Device-resident adapters pinned by a running sequence."""
        return sum(1 for i in self.resident.values() if self.by_id[i].running > 0)

    @property
    def host_count(self) -> int:
        return sum(1 for a in self.by_id.values() if a.weights is not None)

    def check(self) -> None:
        """Assert the invariants of the module docstring (debug mode: after every step)."""
        self.pool.check()
        assert set(self.pool.runs) == set(self.resident), "device runs != resident adapters"
        assert len(self.resident) <= self.max_loras, f"{len(self.resident)} on the device"
        assert self.host_count <= self.max_cpu_loras, f"{self.host_count} in host memory"
        for slot, adapter_id in self.resident.items():
            a = self.by_id[adapter_id]
            assert a.slot == slot and a.weights is not None, f"{a.name}: bad device state"
            assert self.pool.runs[slot] == self.pool.units_for(a.rank), f"{a.name}: run size"
        for a in self.by_id.values():
            assert a.running <= a.active, f"{a.name}: more running than active"
            assert a.running == 0 or a.slot is not None, f"{a.name} runs off the device"

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
