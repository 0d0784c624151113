"""AdapterCache: three tiers of adapters, all bookkeeping, no torch.

    disk (name -> path)  ->  host memory (HostTier, max_cpu_loras)
                         ->  device pool (DeviceTier, max_loras, rank units)

Registering an adapter costs its metadata; its weights are read when a request needs them.
On the device an adapter of rank r owns ``ceil(r / rank_unit)`` units of the rank-row pool
(``RankPool``), and at most ``max_loras`` adapters are resident.

Who owns what: the cache owns the adapter records (``names``, ``by_id``; it alone writes
them), the queue's next uses (``next_use``, lent to the tiers per call) and the lookup
counts; ``HostTier`` owns the host copies, the reads in flight and its LRU, ``DeviceTier``
the runs (slot <-> adapter) and its LRU; each counts its own loads. A use (``acquire``,
``release``) stamps both tiers' LRUs; a tier also stamps what it just took in (a read
taken, a run placed).

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
  and run until its last request ends (``active == 0``), then is dropped;
- every load of a name gets a new adapter id (prefix-cache hashes are seeded by it, so no
  KV of an old version is reused) and a version one above the name's last (kept across
  unloads, so a version number never names two loads);
- a replace of the same shape (as many pool units) reuses the old version's run: the new
  weights are written into it once the old version is idle (at once when it already is),
  with no allocation and no compaction; two copies are held only while old requests run.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import AdapterExistsError, AdapterFaultError, AdapterNotFoundError
from .cache_report import CacheReport
from .cached_adapter import (
    AdapterInfo,
    CachedAdapter,
)
from .device_tier import DeviceTier
from .host_tier import HostTier
from .rank_pool import RankPool

if TYPE_CHECKING:
    from .peft_format import AdapterMeta, LoRAWeights
    from .token_rows import TokenRows


class AdapterCache(CacheReport):
    """The three tiers' door (module docstring); what it reports: cache_report.py."""

    def __init__(
        self,
        max_loras: int,
        max_cpu_loras: int,
        pool: RankPool,
        read: Callable[[AdapterMeta], LoRAWeights],  # raises on a bad adapter
        load_slot: Callable[[int, LoRAWeights], None],  # copy weights into the run at a slot
        clear_slot: Callable[[int], None],
        move_slot: Callable[[int, int, int], None] | None = None,  # (src, dst, rank rows)
        max_concurrent_reads: int = 4,
        look_ahead_loads: int = 4,
        on_drop: Callable[[Path], None] | None = None,  # an owned adapter's dir is done with
    ):
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.pool = pool
        self.look_ahead_loads = look_ahead_loads  # device loads started ahead, per step
        self._on_drop = on_drop
        self.names: dict[str, CachedAdapter] = {}  # live registrations
        self.by_id: dict[int, CachedAdapter] = {}  # live and retired-but-busy adapters
        self.next_use: dict[int, int] = {}  # adapter id -> queue position of its next request
        self.lookups: Counter[str] = Counter()  # tier -> requests that found their adapter there
        self.versions: Counter[str] = Counter()  # name -> its last load's version
        self._ids = itertools.count(1)  # 0 is the base model
        self.device = DeviceTier(max_loras, pool, load_slot, clear_slot, move_slot)
        self.host = HostTier(max_cpu_loras, read, max_concurrent_reads, self.device.evict)

    # ---- registration (engine thread) ----------------------------------------------------
    def check_name(self, name: str, replace: bool) -> None:
        """ValueError for an empty name, AdapterExistsError for a taken one without
        ``replace``."""
        if not name:
            raise ValueError("adapter name must be non-empty")
        if name in self.names and not replace:
            raise AdapterExistsError(
                f"adapter {name!r} already exists; load it in place (replace / load_inplace) "
                "to swap it for a new version")

    def register(self, name: str, meta: AdapterMeta, replace: bool = False, pin: bool = False,
                 preloaded: bool = False, weights: LoRAWeights | None = None,
                 owned: bool = False, version: int | None = None) -> AdapterInfo:
        """Register an adapter under ``name`` from its validated ``meta`` (``path``, ``rank``,
        ``target_modules``, ``size_bytes``); ``weights``, when already read, go to host
        memory. The old adapter, if replaced, finishes its in-flight requests on its own
        weights. ``owned``: ``on_drop(path)`` is called once the adapter is dropped.
        ``version``: the number a cluster gave this load (Ray: the registry's), else one
        above the name's last."""
        self.check_name(name, replace)
        old = self.names.get(name)
        if pin and sum(a.pinned for a in self.names.values() if a is not old) >= self.max_loras:
            raise ValueError(f"at most max_loras={self.max_loras} adapters can be pinned")
        version = self.versions[name] + 1 if version is None else version
        self.versions[name] = max(self.versions[name], version)
        a = CachedAdapter(name, meta, next(self._ids), version, pin, preloaded, owned)
        if weights is not None:
            self.host.put(a, weights)
        if old is not None:
            del self.names[name]
            old.retired = True
        self.names[name] = self.by_id[a.adapter_id] = a
        if old is not None:
            self._drop_if_idle(old)  # idle: its run goes to ``a`` at once
        if weights is not None:
            self.host.trim(a, self.next_use)
        return self._info(a)

    def remove(self, name: str) -> None:
        """New requests get NOT_FOUND at once; in-flight ones finish first."""
        a = self.names.get(name)
        if a is None:
            raise AdapterNotFoundError(f"unknown adapter {name!r}; loaded: {sorted(self.names)}")
        del self.names[a.name]
        a.retired = True
        self._drop_if_idle(a)

    def _drop_if_idle(self, a: CachedAdapter) -> None:
        if a.retired and a.active == 0:
            successor = self.names.get(a.name)
            weights = None if successor is None else self.host.weights(successor)
            if successor is not None and weights is not None:
                self.device.hand_over(a, successor, weights)  # same shape: its run
            self.device.evict(a)
            self.host.drop(a)
            self.by_id.pop(a.adapter_id, None)
            self.next_use.pop(a.adapter_id, None)
            if a.owned and self._on_drop is not None:
                self._on_drop(a.path)

    # ---- requests -----------------------------------------------------------------------
    def lookup(self, name: str) -> int:
        a = self.names.get(name)
        if a is None:
            raise AdapterNotFoundError(
                f"unknown adapter {name!r}; loaded adapters: {sorted(self.names) or 'none'}")
        if a.error is not None:  # until replaced or unloaded
            raise AdapterFaultError(f"adapter {name!r} failed to load: {a.error}; replace or "
                                    "unload it")
        return a.adapter_id

    def prefetch(self, name: str) -> None:
        """Any thread: start reading ``name`` from disk now, while its request is on its way
        to the engine thread (which adopts the read in ``request_started`` or
        ``look_ahead``), so that the read overlaps the step in progress. No-op when the
        adapter is unknown, held, being read, or ``max_concurrent_reads`` early reads are
        waiting to be adopted; one nobody adopts within ``EARLY_READ_TTL_S`` is dropped."""
        a = self.names.get(name)  # one dict read: safe beside the engine thread
        if a is not None:
            self.host.prefetch(a)

    def bind(self, adapter_id: int, name: str) -> CachedAdapter:
        """Engine thread: the load a request made for load ``adapter_id`` of ``name`` (on
        another thread, before it reached the engine) runs on: that load while it serves
        new requests; the name's current load once a load in place replaced it in between;
        AdapterNotFoundError once the name was unloaded (or its new load failed)."""
        a = self.by_id.get(adapter_id)
        if a is not None and not a.retired:
            return a
        if name not in self.names:
            raise AdapterNotFoundError(f"adapter {name!r} was unloaded")
        return self.by_id[self.lookup(name)]

    def request_started(self, adapter_id: int, needs_weights: bool = True) -> None:
        """A request for the adapter arrived: counts where it found the adapter (the cache's
        hit rate per tier) and starts its read when a reader is free (if it ``needs_weights``)."""
        a = self.by_id[adapter_id]
        a.active += 1
        if not needs_weights:  # an aLoRA never invoked runs the base model
            return
        tier = "device" if self.device.slot(a) is not None else \
            "host" if self.host.weights(a) is not None else "disk"
        self.lookups[tier] += 1
        if tier == "disk":
            self.host.start_read(a, self.next_use)

    def request_done(self, adapter_id: int) -> None:
        a = self.by_id.get(adapter_id)
        if a is not None:
            a.active -= 1
            self._drop_if_idle(a)

    def renumber(self, name: str, adapter_id: int, version: int) -> None:
        """The load ``adapter_id`` of ``name`` is ``version`` (a cluster's number, known
        once its registry committed the load); no-op if another load replaced it."""
        a = self.names.get(name)
        if a is not None and a.adapter_id == adapter_id:
            a.version = version
            self.versions[name] = max(self.versions[name], version)

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
        self.host.drop_stale_early()
        self.next_use = {}
        for pos, adapter_id in enumerate(queue):
            if adapter_id and adapter_id in self.by_id:
                self.next_use.setdefault(adapter_id, pos)
        reads = self.host.read_room(self.next_use)
        device_loads = 0
        for adapter_id, pos in self.next_use.items():  # insertion order: nearest first
            a = self.by_id[adapter_id]
            if self.host.reading(a):
                self._collect(a)
            weights = self.host.weights(a)
            if self.host.needs_read(a):
                if not self.host.adopt_early(a) and reads > 0:
                    self.host.begin_read(a)
                    reads -= 1
            elif (place and weights is not None and self.device.slot(a) is None
                  and device_loads < self.look_ahead_loads
                  and self.device.place(a, weights, self.next_use, evict_for=pos)):
                device_loads += 1

    def _collect(self, a: CachedAdapter) -> None:
        error = self.host.collect(a, self.next_use)
        if error is not None:
            a.error = error

    def acquire(self, adapter_id: int) -> bool:
        a = self.by_id[adapter_id]
        self._collect(a)
        if self.device.slot(a) is None:
            weights = self.host.weights(a)
            if weights is None:
                return False  # on disk or loading: a loader thread is on it
            if not self.device.place(a, weights, self.next_use):
                return False
        a.running += 1
        self._touch(a)
        return True

    def release(self, adapter_id: int) -> None:
        a = self.by_id[adapter_id]
        a.running -= 1
        self._touch(a)

    def _touch(self, a: CachedAdapter) -> None:
        self.host.touch(a)
        self.device.touch(a)

    def ready(self, adapter_id: int) -> bool:
        """In host memory (or on the device): what it may still lack is room there."""
        a = self.by_id.get(adapter_id)
        return a is not None and self.host.ready(a)

    def on_device(self, adapter_id: int) -> bool:
        a = self.by_id.get(adapter_id)
        return a is not None and self.device.slot(a) is not None

    def drain_for(self, adapter_id: int, running: list[int]) -> set[int]:
        """The fewest of the ``running`` adapters, taken in that order, whose runs (once
        their requests end) with the free and idle ones make room for ``adapter_id``."""
        return self.device.drain_for(self.by_id[adapter_id],
                                     [self.by_id[i] for i in running], self.next_use)

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until a read from disk finishes; return at once
        when none is in flight. The engine calls this when a step has nothing to run, so
        that it does not spin (holding the GIL) while the loader threads read."""
        self.host.wait_for_loads(timeout)

    def slot_of(self, adapter_id: int) -> int:
        """The slot of a resident adapter (one ``acquire`` placed)."""
        return self.device.slots[self.by_id[adapter_id]]

    def token_rows(self, adapter_id: int) -> TokenRows | None:
        """A resident adapter's own embedding / head rows (lora/token_rows.py); None when it
        has none (held in host memory: host ⊇ device)."""
        weights = self.host.weights(self.by_id[adapter_id])
        return None if weights is None else weights.tokens

    def shutdown(self) -> None:
        self.host.shutdown()
