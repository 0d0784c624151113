"""CachedAdapter: what the adapter cache knows of one registered adapter (its registration,
its requests, its last use), AdapterInfo (what ListAdapters reports of it), and the
eviction order both tiers share. Where its weights are (host copy, read in flight, device
run) is the tiers' state, not the record's: HostTier and DeviceTier key their tables by it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .peft_format import AdapterMeta

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


@dataclass(eq=False)  # compared and hashed by identity: the tiers' tables are keyed by it
class CachedAdapter:
    """One load of a name. The cache owns it and alone writes it; the tiers read
    ``pinned``, ``running`` and ``error``."""

    name: str
    meta: AdapterMeta  # what registration validated: the loader reads by it
    adapter_id: int
    version: int = 1  # the name's load count when this load was registered
    pinned: bool = False
    preloaded: bool = False
    owned: bool = False  # its dir is an upload: removed once the adapter is dropped
    active: int = 0  # unfinished requests (waiting or running)
    running: int = 0  # running sequences: they pin its device run
    retired: bool = False  # unloaded or replaced: serves only its in-flight requests
    error: str | None = None  # its read from disk failed: requests for it are refused

    @property
    def path(self) -> Path:
        return Path(self.meta.path)

    @property
    def rank(self) -> int:
        return self.meta.rank

    def info(self, state: str, slot: int | None) -> AdapterInfo:
        """Its report, given its ``state`` and device ``slot`` (the tiers')."""
        meta = self.meta
        return AdapterInfo(self.name, str(self.path), state, meta.rank,
                           list(meta.target_modules), meta.size_bytes, self.active,
                           self.pinned, self.preloaded, self.adapter_id,
                           -1 if slot is None else slot, self.error, self.version)


def eviction_order(adapters: list[CachedAdapter], next_use: Mapping[int, int],
                   last_used: Mapping[CachedAdapter, int]) -> list[CachedAdapter]:
    """The first to evict first: those no waiting request needs, then the furthest next
    use (``next_use``: adapter id -> queue position), then the least recently used
    (``last_used``: the tier's own stamps)."""
    return sorted(adapters, key=lambda a: (-next_use.get(a.adapter_id, NEVER),
                                           last_used.get(a, 0)))
