"""AdapterCache: three tiers of adapters, all bookkeeping, no torch.

    disk (name -> path)  ->  host memory (LRU, max_cpu_loras)  ->  device slot (max_loras)

Invariants:
- an adapter in a device slot is also held in host memory (host ⊇ device);
- a slot whose adapter has a running sequence (``running > 0``) is never taken;
- eviction, of a slot or of host memory, takes the least recently used unpinned adapter;
- reading from disk happens on the loader thread, never on the engine step;
- a name maps to one live adapter id; a replaced or removed adapter keeps its id, weights
  and slot until its last request ends (``active == 0``), then is dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import AdapterExistsError, AdapterNotFoundError

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
        read: Callable[[str, Path], Any],  # (name, path) -> weights; raises on a bad adapter
        load_slot: Callable[[int, Any], None],  # copy weights into a device slot
        clear_slot: Callable[[int], None],
    ):
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._read = read
        self._load_slot = load_slot
        self._clear_slot = clear_slot
        self.names: dict[str, _Adapter] = {}  # live registrations
        self.by_id: dict[int, _Adapter] = {}  # live and retired-but-busy adapters
        self.slots: list[int | None] = [None] * max_loras  # slot -> adapter id
        self._ids = itertools.count(1)  # 0 is the base model
        self._clock = itertools.count(1)
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="loraplex-adapter-loader")

    # ---- registration (engine thread) ----------------------------------------------------
    def register(self, name: str, weights: Any, replace: bool = False, pin: bool = False,
                 preloaded: bool = False) -> AdapterInfo:
        """Register validated ``weights`` under ``name``; the old one, if replaced, finishes
        its in-flight requests on the old weights."""
        if not name:
            raise ValueError("adapter name must be non-empty")
        old = self.names.get(name)
        if old is not None and not replace:
            raise AdapterExistsError(f"adapter {name!r} already exists; pass replace to swap it")
        if pin and sum(a.pinned for a in self.names.values() if a is not old) >= self.max_loras:
            raise ValueError(f"at most max_loras={self.max_loras} adapters can be pinned")
        if old is not None:
            self._retire(old)
        a = _Adapter(name, Path(weights.path), next(self._ids), weights.rank,
                     list(weights.target_modules), weights.size_bytes, pin, preloaded,
                     weights=weights, last_used=next(self._clock))
        self.names[name] = self.by_id[a.adapter_id] = a
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
            if a.slot is not None:
                self._clear_slot(a.slot)
                self.slots[a.slot] = None
            a.slot, a.weights = None, None
            self.by_id.pop(a.adapter_id, None)

    # ---- requests ---------------------------------------------------------------------
    def lookup(self, name: str) -> int:
        a = self.names.get(name)
        if a is None:
            raise AdapterNotFoundError(
                f"unknown adapter {name!r}; loaded adapters: {sorted(self.names) or 'none'}")
        if a.error is not None:
            raise AdapterNotFoundError(f"adapter {name!r} failed to load: {a.error}")
        return a.adapter_id

    def request_started(self, adapter_id: int) -> None:
        a = self.by_id[adapter_id]
        a.active += 1
        if a.weights is None and a.loading is None:
            self._start_loading(a)  # prefetch while the request waits

    def request_done(self, adapter_id: int) -> None:
        a = self.by_id.get(adapter_id)
        if a is not None:
            a.active -= 1
            self._drop_if_idle(a)

    def failed(self, adapter_id: int) -> str | None:
        a = self.by_id.get(adapter_id)
        return None if a is None else a.error

    # ---- scheduler door -----------------------------------------------------------------
    def acquire(self, adapter_id: int) -> bool:
        a = self.by_id[adapter_id]
        self._collect(a)
        if a.slot is None:
            if a.weights is None:
                return False  # on disk or loading: the loader thread is on it
            slot = self._free_slot()
            if slot is None:
                return False
            self._load_slot(slot, a.weights)
            self.slots[slot], a.slot = a.adapter_id, slot
        a.running += 1
        a.last_used = next(self._clock)
        return True

    def release(self, adapter_id: int) -> None:
        a = self.by_id[adapter_id]
        a.running -= 1
        a.last_used = next(self._clock)

    def ready(self, adapter_id: int) -> bool:
        """In host memory (or in a slot): what it may still lack is a free slot."""
        a = self.by_id.get(adapter_id)
        return a is not None and (a.weights is not None
                                  or (a.loading is not None and a.loading.done()))

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds until a read from disk finishes; return at once
        when none is in flight. The engine calls this when a step has nothing to run, so
        that it does not spin (holding the GIL) while the loader thread reads."""
        pending = [a.loading for a in self.by_id.values() if a.loading is not None]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    def slot_of(self, adapter_id: int) -> int:
        return self.by_id[adapter_id].slot  # type: ignore[return-value]

    def _free_slot(self) -> int | None:
        """An empty slot, else the slot of the least recently used idle unpinned adapter."""
        if None in self.slots:
            return self.slots.index(None)
        idle = [self.by_id[i] for i in self.slots
                if i is not None and self.by_id[i].running == 0 and not self.by_id[i].pinned]
        if not idle:
            return None
        victim = min(idle, key=lambda a: a.last_used)
        slot, victim.slot = victim.slot, None
        self._clear_slot(slot)
        self.slots[slot] = None
        return slot

    # ---- host tier ----------------------------------------------------------------------
    def _start_loading(self, a: _Adapter) -> None:
        a.loading = self._loader.submit(self._read, a.name, a.path)

    def _collect(self, a: _Adapter) -> None:
        """Take the loader thread's result, if it is ready."""
        if a.loading is None or not a.loading.done():
            if a.weights is None and a.loading is None and a.error is None:
                self._start_loading(a)
            return
        fut, a.loading = a.loading, None
        try:
            a.weights = fut.result()
        except Exception as e:  # noqa: BLE001 - a broken file on disk fails the adapter
            a.error = f"reloading {a.path} failed: {e}"
            return
        a.last_used = next(self._clock)
        self._trim_host(keep=a)

    def _trim_host(self, keep: _Adapter | None = None) -> None:
        """Keep at most max_cpu_loras adapters in host memory. Victims are unpinned and not
        running; those no request waits for go first, least recently used first. A victim
        in a device slot leaves the slot too (host ⊇ device)."""
        held = [a for a in self.by_id.values() if a.weights is not None]
        spare = sorted((a for a in held if a is not keep and not a.pinned and a.running == 0),
                       key=lambda a: (a.active > 0, a.last_used))
        for a in spare[: max(0, len(held) - self.max_cpu_loras)]:
            if a.slot is not None:
                self._clear_slot(a.slot)
                self.slots[a.slot], a.slot = None, None
            a.weights = None

    # ---- reporting ----------------------------------------------------------------------
    def info(self, a: _Adapter) -> AdapterInfo:
        return AdapterInfo(a.name, str(a.path), a.state, a.rank, list(a.target_modules),
                           a.size_bytes, a.active, a.pinned, a.preloaded, a.adapter_id,
                           -1 if a.slot is None else a.slot, a.error)

    def list(self) -> list[AdapterInfo]:
        return [self.info(a) for a in sorted(self.names.values(), key=lambda a: a.name)]

    @property
    def slots_in_use(self) -> int:
        return sum(1 for i in self.slots if i is not None and self.by_id[i].running > 0)

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)


