"""RegistryFollower: one replica's side of the AdapterRegistry (registry.py): it joins, makes
its engine hold exactly the registry's adapters, and keeps following the registry's
changes (a long poll on the actor, acknowledged with the version applied).

Applying a snapshot: an adapter whose registry version differs from the one this replica
loaded is (re)loaded with replace, from the registry's path (weights read off the engine
thread); an adapter the registry no longer has is removed (its in-flight requests finish).
A load that fails here (say the path is not readable on this node) is logged and reported
by ``failures``; the replica still acknowledges, so one bad node cannot stall the cluster.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from ray.exceptions import RayActorError

from ...engine.async_engine import AsyncEngine
from .registry import LAUNCH_VERSION, Entry, Snapshot

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 2.0


class RegistryFollower:
    def __init__(self, registry: Any, member: str, engine: AsyncEngine,
                 preloaded: dict[str, str]):
        self.registry = registry  # a Ray actor handle of AdapterRegistry
        self.member = member
        self.engine = engine
        self.applied = -1
        # the registry version loaded here: the engine loaded --lora-modules as its first
        # loads, which the registry numbers LAUNCH_VERSION too
        self.versions = {name: LAUNCH_VERSION for name in preloaded}
        self.failures: dict[str, str] = {}  # adapter -> why this replica could not load it
        self._task: asyncio.Task | None = None

    async def join(self) -> None:
        """Join and apply the whole list (call in the replica's __init__), then follow."""
        snapshot = await self.registry.watch.remote(self.member, -1, 0.0)
        await self.apply(snapshot)
        self._task = asyncio.ensure_future(self._follow())

    async def _follow(self) -> None:
        while True:
            try:
                snapshot = await self.registry.watch.remote(self.member, self.applied,
                                                            WATCH_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if isinstance(e, RayActorError):  # the registry restarting: expected
                    log.warning("registry watch failed (%s); retrying", type(e).__name__)
                else:
                    log.exception("registry watch failed; retrying")
                await asyncio.sleep(1.0)
                continue
            if snapshot is not None:
                await self.apply(snapshot)

    async def apply(self, snapshot: Snapshot) -> None:
        for entry in snapshot.entries.values():
            if self.versions.get(entry.name) != entry.version:
                await self._load(entry)
                self.registry.touch.remote(self.member)
        for name in [n for n in self.versions if n not in snapshot.entries]:
            await self._remove(name)
        self.applied = max(self.applied, snapshot.version)

    async def _load(self, entry: Entry) -> None:
        model = self.engine.engine
        try:
            root = Path(entry.root) if entry.root is not None else None  # confined as loaded
            weights = await asyncio.to_thread(model.read_adapter, entry.path, entry.name,
                                              root=root, shown=entry.shown)
            await self.engine.run(lambda e: e.add_adapter(
                entry.name, entry.path, replace=True, pin=entry.pin,
                preloaded=entry.preloaded, weights=weights,
                version=entry.version or None))  # the cluster's number for this load
            self.failures.pop(entry.name, None)
        except Exception as e:  # noqa: BLE001 - reported, not fatal to the replica
            log.error("replica %s cannot load adapter %r from %s: %s", self.member,
                      entry.name, entry.path, e)
            self.failures[entry.name] = f"{type(e).__name__}: {e}"
        self.versions[entry.name] = entry.version

    async def _remove(self, name: str) -> None:
        del self.versions[name]
        self.failures.pop(name, None)
        if name in {a.name for a in await self.engine.run(lambda e: e.list_adapters())}:
            await self.engine.run(lambda e: e.remove_adapter(name))

    async def resync(self, name: str, snapshot: Snapshot) -> None:
        """Make ``name`` here what ``snapshot`` says, whatever this replica loaded."""
        self.versions[name] = -1
        await self.apply(snapshot)

    def mark_loaded(self, name: str, version: int) -> None:
        """This replica itself loaded ``name`` at ``version`` (the admin call came here)."""
        self.versions[name] = max(self.versions.get(name, -1), version)

    def mark_removed(self, name: str) -> None:
        self.versions.pop(name, None)

    async def leave(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            await self.registry.leave.remote(self.member)
        except Exception as e:  # noqa: BLE001 - the registry may be gone first at shutdown
            log.info("replica %s could not leave the registry: %s", self.member, e)
