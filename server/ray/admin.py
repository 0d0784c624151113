"""ClusterAdminServicer: AdapterAdmin for a Ray Serve deployment. A call arrives at one
replica; it runs server/adapter_ops.py there (the same name rules, ``--adapter-root``
confinement and errors as one server), then commits the change to the cluster's
AdapterRegistry and answers only once every live replica has applied it (registry.py states
the guarantee). ListAdapters lists the registry's adapters, each with its tier on every
replica (``AdapterInfo.replicas``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from ...engine.errors import AdapterExistsError
from ...proto import loraplex_pb2 as pb
from .. import adapter_ops, convert
from ..adapter_admin import AdapterAdminServicer
from ..state import ServerState
from ..status import ServiceError, unary
from .follower import RegistryFollower

APPLY_TIMEOUT_S = 120.0
# replica id -> {adapter name: (state name, active requests)}
ReplicaTiers = dict[str, dict[str, tuple[str, int]]]


class ClusterAdminServicer(AdapterAdminServicer):
    def __init__(self, state: ServerState, follower: RegistryFollower,
                 replica_tiers: Callable[[], Awaitable[ReplicaTiers]]):
        super().__init__(state)
        self.follower = follower
        self.registry = follower.registry
        self.replica_tiers = replica_tiers

    @unary
    async def LoadAdapter(self, request: pb.LoadAdapterRequest,
                          context: grpc.aio.ServicerContext) -> pb.AdapterInfo:
        info = await adapter_ops.load_adapter(self.state, request.name, request.path,
                                              replace=request.replace, pin=request.pin)
        change = await self.registry.register.remote(info.name, str(info.path),
                                                     request.replace, request.pin)
        if change.refused is not None:  # a concurrent load of the same name won
            await self.follower.resync(info.name)
            raise AdapterExistsError(change.refused)
        self.follower.mark_loaded(info.name, change.version)
        await self._wait_applied(change.version, f"adapter {info.name!r} is registered")
        return convert.adapter_info(info)

    @unary
    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest,
                            context: grpc.aio.ServicerContext) -> pb.UnloadAdapterResponse:
        await adapter_ops.unload_adapter(self.state, request.name)
        self.follower.mark_removed(request.name)
        change = await self.registry.unregister.remote(request.name)
        if change.refused is None:  # else a concurrent unload already removed it
            await self._wait_applied(change.version, f"adapter {request.name!r} is unloaded")
        return pb.UnloadAdapterResponse(name=request.name)

    @unary
    async def ListAdapters(self, request: pb.ListAdaptersRequest,
                           context: grpc.aio.ServicerContext) -> pb.ListAdaptersResponse:
        snapshot = await self.registry.snapshot.remote()
        local = {i.name: i for i in await adapter_ops.list_adapters(self.state)}
        tiers = await self.replica_tiers()
        adapters = []
        for name, entry in sorted(snapshot.entries.items()):
            info = (convert.adapter_info(local[name]) if name in local else
                    pb.AdapterInfo(name=name, path=entry.path, pinned=entry.pin,
                                   preloaded=entry.preloaded))
            info.active_requests = 0
            for replica, held in sorted(tiers.items()):
                state, active = held.get(name, ("STATE_UNSPECIFIED", 0))
                info.replicas.add(replica=replica, state=_state_number(state),
                                  active_requests=active)
                info.active_requests += active
            adapters.append(info)
        return pb.ListAdaptersResponse(adapters=adapters)

    async def _wait_applied(self, version: int, done: str) -> None:
        behind = await self.registry.wait_applied.remote(version, APPLY_TIMEOUT_S)
        if behind:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               f"{done}, but replicas {', '.join(behind)} have not applied it "
                               f"within {APPLY_TIMEOUT_S:.0f}s; they will when they can")


def _state_number(state: str) -> int:
    values = pb.AdapterInfo.State.DESCRIPTOR.values_by_name
    return values[state].number if state in values else pb.AdapterInfo.STATE_UNSPECIFIED


def local_tiers(infos: list[Any], failures: dict[str, str]) -> dict[str, tuple[str, int]]:
    """This replica's {adapter: (state, active requests)}; FAILED where it could not load."""
    held = {i.name: (i.state, i.active_requests or 0) for i in infos}
    held.update({name: ("FAILED", 0) for name in failures})
    return held
