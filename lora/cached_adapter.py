"""CachedAdapter: what the adapter cache knows of one registered adapter (its tier state
included), AdapterInfo (what ListAdapters reports of it), and the eviction order both
tiers share."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NEVER = 1 << 62  # the next use of an adapter no waiting request needs
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
    version: int = 1  # rises with each load of the name (a replace is a new version)


@dataclass
class CachedAdapter:
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
    slot: int | None = None  # first unit of its run in the device pool
    active: int = 0  # unfinished requests (waiting or running)
    running: int = 0  # running sequences: they pin the slot
    last_used: int = 0
    retired: bool = False  # unloaded or replaced: serves only its in-flight requests
    error: str | None = None
    version: int = 1  # the name's load count when this load was registered
    owned: bool = False  # its dir is an upload: removed once the adapter is dropped

    @property
    def state(self) -> str:
        if self.error is not None:
            return FAILED
        if self.slot is not None:
            return ON_DEVICE
        if self.weights is not None:
            return ON_CPU
        return LOADING if self.loading is not None else ON_DISK

    def info(self) -> AdapterInfo:
        return AdapterInfo(self.name, str(self.path), self.state, self.rank,
                           list(self.target_modules), self.size_bytes, self.active,
                           self.pinned, self.preloaded, self.adapter_id,
                           -1 if self.slot is None else self.slot, self.error, self.version)


def eviction_order(adapters: list[CachedAdapter], next_use: dict[int, int]
                   ) -> list[CachedAdapter]:
    """The first to evict first: those no waiting request needs, then the furthest next
    use (``next_use``: adapter id -> queue position), then the least recently used."""
    return sorted(adapters, key=lambda a: (-next_use.get(a.adapter_id, NEVER), a.last_used))
