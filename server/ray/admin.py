"""ClusterAdapters and ClusterAdminServicer: AdapterAdmin for a Ray Serve deployment (the
HTTP front's load and unload use ClusterAdapters too). A call arrives at one replica; it runs
server/adapter_ops.py there (the same name rules, ``--adapter-root``
confinement and errors as one server), then commits the change to the cluster's
AdapterRegistry and answers only once every live replica has applied it (registry.py states
the guarantee). ListAdapters lists the registry's adapters, each with its tier on every
replica (``AdapterInfo.replicas``) and, as its top-level state, the best of those tiers
(``best_state``)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from ray.exceptions import ActorDiedError, RayActorError

from ...errors import AdapterExistsError
from ...lora.cached_adapter import AdapterInfo
from ...proto import loraplex_pb2 as pb
from .. import adapter_ops
from ..error_code import ErrorCode, ServiceError
from ..grpc import proto_convert
from ..grpc.adapter_admin import AdapterAdminServicer
from ..grpc.status import unary
from ..state import ServerState
from .follower import RegistryFollower

APPLY_TIMEOUT_S = 120.0
UPLOADS_NEED_A_SHARED_DIR = (
    "UploadAdapter with --ray needs --upload-dir: every replica loads the uploaded adapter "
    "from that directory, so it must be storage every node reads at the same path; restart "
    "with --upload-dir DIR, or use LoadAdapter with a path every node reads")
REGISTRY_RETRY_S = 30.0  # how long a registry call is retried while Ray restarts the actor
# (a replica's handle can see the restarted actor as unavailable for over 10 s on a
# loaded machine after the driver already reaches it: seen in make test)
# replica id -> {adapter name: (state name, active requests)}
ReplicaTiers = dict[str, dict[str, tuple[str, int]]]
# the top-level state of a cluster listing: the best tier any replica holds, worst first
_TIER_ORDER = ("STATE_UNSPECIFIED", "FAILED", "ON_DISK", "LOADING", "ON_CPU", "ON_DEVICE")


class ClusterAdapters:
    """load / unload for the cluster (what LoadAdapter, UnloadAdapter and HTTP's
    /v1/load_lora_adapter, /v1/unload_lora_adapter call on a replica): applied here through
    server/adapter_ops.py, then committed to the registry; each returns once every live
    replica has applied the change."""

    def __init__(self, state: ServerState, follower: RegistryFollower):
        self.state = state
        self.follower = follower
        self.registry = follower.registry

    async def registry_call(self, method: str, *args: Any) -> Any:
        """A call on the registry actor. While Ray restarts it (it resumes its state, see
        registry.py) a call can fail without saying whether it ran: every call the
        replicas make is safe to repeat, so it is repeated, for up to REGISTRY_RETRY_S;
        then UNAVAILABLE."""
        deadline = time.monotonic() + REGISTRY_RETRY_S
        while True:
            try:
                return await getattr(self.registry, method).remote(*args)
            except RayActorError as e:
                if isinstance(e, ActorDiedError) or time.monotonic() > deadline:
                    raise ServiceError(ErrorCode.UNAVAILABLE,
                                       f"the adapter registry is unavailable ({method}: "
                                       f"{type(e).__name__}); retry the call") from e
                await asyncio.sleep(0.2)

    async def load(self, name: str, path: str, replace: bool = False, pin: bool = False,
                   source: str = "path") -> AdapterInfo:
        if source == "upload" and self.state.options.upload_dir is None:
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, UPLOADS_NEED_A_SHARED_DIR)
        info = await adapter_ops.load_adapter(self.state, name, path, replace=replace, pin=pin,
                                              source=source)
        # every replica reads it confined as this one did (the follower passes them on)
        _, root, shown = adapter_ops.source_files(self.state, info.name, path, source)
        change = await self.registry_call("register", info.name, str(info.path), replace, pin,
                                          uuid.uuid4().hex, None if root is None else str(root),
                                          shown)
        if change.refused is not None:  # a concurrent load of the same name won
            await self.follower.resync(info.name, await self.registry_call("snapshot"))
            raise AdapterExistsError(change.refused)
        self.follower.mark_loaded(info.name, change.version)
        # every replica numbers this load as the registry did (its change version)
        await self.state.require_engine().run(
            lambda e: e.lora.renumber(info.name, info.adapter_id, change.version))
        info.version = change.version
        await self._wait_applied(change.version, f"adapter {info.name!r} is registered")
        return info

    async def unload(self, name: str) -> None:
        await adapter_ops.unload_adapter(self.state, name)
        self.follower.mark_removed(name)
        change = await self.registry_call("unregister", name)
        if change.refused is None:  # else a concurrent unload already removed it
            await self._wait_applied(change.version, f"adapter {name!r} is unloaded")

    async def _wait_applied(self, version: int, done: str) -> None:
        behind = await self.registry_call("wait_applied", version, APPLY_TIMEOUT_S)
        if behind:
            raise ServiceError(ErrorCode.UNAVAILABLE,
                               f"{done}, but replicas {', '.join(behind)} have not applied it "
                               f"within {APPLY_TIMEOUT_S:.0f}s; they will when they can")


class ClusterAdminServicer(AdapterAdminServicer):
    """The single server's LoadAdapter and UnloadAdapter, on ClusterAdapters; ListAdapters
    from the registry, with every replica's tiers."""

    def __init__(self, state: ServerState, adapters: ClusterAdapters,
                 replica_tiers: Callable[[], Awaitable[ReplicaTiers]]):
        super().__init__(state, adapters)
        self.cluster = adapters
        self.replica_tiers = replica_tiers

    @unary
    async def UploadAdapter(self, requests: Any, context: grpc.aio.ServicerContext
                            ) -> pb.AdapterInfo:
        if self.state.options.upload_dir is None:  # refused before any byte is read
            raise ServiceError(ErrorCode.FAILED_PRECONDITION, UPLOADS_NEED_A_SHARED_DIR)
        return await AdapterAdminServicer.UploadAdapter.__wrapped__(self, requests, context)

    @unary
    async def ListAdapters(self, request: pb.ListAdaptersRequest,
                           context: grpc.aio.ServicerContext) -> pb.ListAdaptersResponse:
        snapshot = await self.cluster.registry_call("snapshot")
        local = {i.name: i for i in await adapter_ops.list_adapters(self.state)}
        tiers = await self.replica_tiers()
        adapters = []
        for name, entry in sorted(snapshot.entries.items()):
            info = (proto_convert.adapter_info(local[name]) if name in local else
                    pb.AdapterInfo(name=name, path=entry.path, pinned=entry.pin,
                                   preloaded=entry.preloaded))
            info.active_requests = 0
            states = []
            for replica, held in sorted(tiers.items()):
                state, active = held.get(name, ("STATE_UNSPECIFIED", 0))
                info.replicas.add(replica=replica, state=proto_convert.state_number(state),
                                  active_requests=active)
                info.active_requests += active
                states.append(state)
            if states:  # else (no replica answered) this replica's own view stays
                info.state = proto_convert.state_number(best_state(states))
            adapters.append(info)
        return pb.ListAdaptersResponse(adapters=adapters)


def best_state(states: list[str]) -> str:
    """The cluster's state of one adapter: the best tier any replica holds (ON_DEVICE over
    ON_CPU over LOADING over ON_DISK over FAILED); FAILED only when every replica failed."""
    return max(states, key=lambda s: _TIER_ORDER.index(s) if s in _TIER_ORDER else 0)


def local_tiers(infos: list[Any], failures: dict[str, str]) -> dict[str, tuple[str, int]]:
    """This replica's {adapter: (state, active requests)}; FAILED where it could not load."""
    held = {i.name: (i.state, i.active_requests or 0) for i in infos}
    held.update({name: ("FAILED", 0) for name in failures})
    return held
