"""The Ray Serve deployment: one replica = one AsyncEngine, and one ingress class for every
RPC of ``loraplex.v1`` and ``grpc.health.v1.Health/Check`` (Ray's gRPC proxy routes on the
method name alone, so method names are unique across the services).

Every call goes through server/grpc/'s own servicers (inference.py, adapter_admin.py via
admin.py, server_info.py), so request checks, conversions, admission and status codes are
the single server's; ProxyContext (context.py) carries their ``abort`` onto Ray's context,
and the token rule is server/auth.py's. Per replica:

- ``loraplex-replica`` (the replica id) is a trailer of every Inference response (and a
  header of every HTTP response: the OpenAI-compatible front, http_front.py, served through
  Ray's HTTP proxy);
- the adapter of an Inference call is reported to Ray's multiplexing
  (``@serve.multiplexed``, up to ``max_cpu_loras`` names per replica), so Ray routes the
  adapter's next requests to the replicas holding it. The engine's tiered cache stays the
  cache: the multiplexed "model" is only the name;
- a stream's messages carry the code UNAVAILABLE until the last one, which carries OK: the
  proxy keeps the code of the last message it received when the replica dies, so a client
  whose replica dies mid-stream gets the messages sent so far, then UNAVAILABLE (with
  Ray's "actor died" details and the ``loraplex-replica`` trailer), where the proxy alone
  says INTERNAL. Errors the replica raises set their own code. (A proxy timeout,
  RAY_SERVE_REQUEST_PROCESSING_TIMEOUT_S, which loraplex does not set, would read
  UNAVAILABLE mid-stream too, not DEADLINE_EXCEEDED);
- ``check_health`` fails once the engine thread died, so Ray replaces the replica;
- ``Check`` answers SERVING when this replica serves and at least ``min_replicas``
  replicas have joined the adapter registry (each joins after its warm-up).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import ray
from grpc_health.v1 import health_pb2
from ray import serve
from ray.exceptions import RayActorError

from ...engine.engine_config import EngineConfig
from ...engine.llm_engine import LLMEngine
from ...proto import loraplex_pb2 as pb
from ..adapter_ops import list_adapters
from ..adapter_paths import segment_problem
from ..grpc.health import SERVICE_NAMES
from ..grpc.inference import InferenceServicer
from ..grpc.server_info import ServerInfoServicer
from ..http.probes import local_exposition
from ..loraplex_server import LoraplexServer
from ..server_options import ServerOptions
from ..state import Phase
from .admin import ClusterAdapters, ClusterAdminServicer, ReplicaTiers, local_tiers
from .context import REPLICA_TRAILER, ProxyContext, authorize
from .follower import RegistryFollower
from .http_front import merge_expositions, replica_app

log = logging.getLogger(__name__)

_INFERENCE = "/loraplex.v1.Inference/"
_ADMIN = "/loraplex.v1.AdapterAdmin/"
_INFO = "/loraplex.v1.ServerInfo/"
BROADCAST_TIMEOUT_S = 10.0


class StreamAborted(Exception):
    """A stream ends with the status code set on its context (see GenerateStream)."""


@dataclass(frozen=True)
class ReplicaConfig:
    """What every replica is built from (pickled to the replicas): the one EngineConfig the
    command built, its ``lora_modules`` the adapters the registry starts with."""

    engine: EngineConfig
    options: ServerOptions
    registry_name: str
    namespace: str
    min_replicas: int = 1  # health is SERVING once this many replicas have joined

    @property
    def lora_modules(self) -> dict[str, str]:
        return self.engine.lora_modules


class LoraplexReplica:
    """The deployment's class, less the multiplexed method (``deployment_class`` adds it)."""

    async def __init__(self, config: ReplicaConfig):
        self.config = config
        self.options = config.options
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        # exposed: Ray's gRPC proxy listens on every interface, whatever --host says
        self.server = LoraplexServer(config.options,
                                     lambda: LLMEngine.from_config(config.engine), exposed=True)
        await self.server.load()  # build, start the engine thread, warm up: SERVING
        self.state = self.server.state
        registry = ray.get_actor(config.registry_name, namespace=config.namespace)
        self.follower = RegistryFollower(registry, self.replica_id, self.state.engine,
                                         config.lora_modules)
        await self.follower.join()  # every registered adapter, before any traffic
        self.joined = 1  # replicas in the registry, as last heard (Check)
        self.inference = InferenceServicer(self.state)
        self.adapters = ClusterAdapters(self.state, self.follower)
        self.admin = ClusterAdminServicer(self.state, self.adapters, self._replica_tiers)
        self.info = ServerInfoServicer(self.state)
        log.info("replica %s serving", self.replica_id)

    def __serve_build_asgi_app__(self) -> Any:
        """The HTTP front (Ray Serve calls it after __init__): server/http's app with the
        cluster's adapter operations and metrics (http_front.py)."""
        return replica_app(self.state, self.adapters, self.replica_id, self._report_adapter,
                           self._cluster_exposition)

    # ---- Inference ----------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, grpc_context: Any
                       ) -> pb.GenerateResponse:
        ctx = self._inference_context(grpc_context)
        try:
            await authorize(ctx, _INFERENCE + "Generate", self.options)
            await self._report_adapter(request.adapter)
            return await self.inference.Generate(request, ctx)
        except grpc.aio.AbortError:
            return pb.GenerateResponse()

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context: Any
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        ctx = self._inference_context(grpc_context)
        try:
            await authorize(ctx, _INFERENCE + "GenerateStream", self.options)
            await self._report_adapter(request.adapter)
            async for item in self.inference.GenerateStream(request, ctx):
                # the code the proxy keeps if this replica dies after this message
                grpc_context.set_code(grpc.StatusCode.OK if item.finished
                                      else grpc.StatusCode.UNAVAILABLE)
                yield item
        except grpc.aio.AbortError as e:
            # Ray's proxy takes a stream's context from the messages it carries: a code set
            # after the last one only reaches the client when the stream raises (Ray then
            # keeps the code and details set here, but drops the trailers).
            raise StreamAborted(grpc_context.details()) from e
        except Exception:
            grpc_context.set_code(grpc.StatusCode.INTERNAL)  # not the UNAVAILABLE above
            raise

    def _inference_context(self, grpc_context: Any) -> ProxyContext:
        ctx = ProxyContext(grpc_context)
        ctx.add_trailer(REPLICA_TRAILER, self.replica_id)
        return ctx

    async def _report_adapter(self, adapter: str) -> None:
        """Tell Ray's multiplexing this replica holds ``adapter`` (when the client routed
        on it). An unknown adapter is not reported; the servicer answers NOT_FOUND (or
        INVALID_ARGUMENT for a name that is not canonical)."""
        if adapter and serve.get_multiplexed_model_id() == adapter \
                and segment_problem(adapter) is None \
                and self.state.adapter_of(adapter) is not None:
            try:
                await self.hold_adapter(adapter)  # type: ignore[attr-defined]
            except LookupError:
                pass

    async def _check_adapter(self, name: str) -> str:
        engine = self.state.require_engine()
        if not await engine.run(lambda e: any(a.name == name for a in e.list_adapters())):
            raise LookupError(name)
        return name  # the multiplexed "model": the engine's cache holds the weights

    # ---- AdapterAdmin and ServerInfo ------------------------------------------------------
    async def LoadAdapter(self, request: pb.LoadAdapterRequest, grpc_context: Any
                          ) -> pb.AdapterInfo:
        return await self._unary(_ADMIN + "LoadAdapter", self.admin.LoadAdapter, request,
                                 grpc_context, pb.AdapterInfo)

    async def UploadAdapter(self, requests: Any, grpc_context: Any) -> pb.AdapterInfo:
        """Client streaming through Ray's proxy (its gRPCInputStream): written under
        --upload-dir, then loaded on every replica as LoadAdapter loads a path."""
        return await self._unary(_ADMIN + "UploadAdapter", self.admin.UploadAdapter, requests,
                                 grpc_context, pb.AdapterInfo)

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, grpc_context: Any
                            ) -> pb.UnloadAdapterResponse:
        return await self._unary(_ADMIN + "UnloadAdapter", self.admin.UnloadAdapter, request,
                                 grpc_context, pb.UnloadAdapterResponse)

    async def ListAdapters(self, request: pb.ListAdaptersRequest, grpc_context: Any
                           ) -> pb.ListAdaptersResponse:
        return await self._unary(_ADMIN + "ListAdapters", self.admin.ListAdapters, request,
                                 grpc_context, pb.ListAdaptersResponse)

    async def GetServerInfo(self, request: pb.GetServerInfoRequest, grpc_context: Any
                            ) -> pb.GetServerInfoResponse:
        return await self._unary(_INFO + "GetServerInfo", self.info.GetServerInfo, request,
                                 grpc_context, pb.GetServerInfoResponse)

    async def GetStats(self, request: pb.GetStatsRequest, grpc_context: Any
                       ) -> pb.GetStatsResponse:
        """The sum over every replica (each replica's own GetStats)."""
        return await self._unary(_INFO + "GetStats", self._cluster_stats, request,
                                 grpc_context, pb.GetStatsResponse)

    async def _unary(self, method: str, call: Any, request: Any, grpc_context: Any,
                     empty: type) -> Any:
        ctx = ProxyContext(grpc_context)
        try:
            await authorize(ctx, method, self.options)
            return await call(request, ctx)
        except grpc.aio.AbortError:
            return empty()

    async def _cluster_stats(self, request: pb.GetStatsRequest, ctx: ProxyContext
                             ) -> pb.GetStatsResponse:
        total = pb.GetStatsResponse()
        for stats in await self._broadcast("local_stats"):
            for f in pb.GetStatsResponse.DESCRIPTOR.fields:
                setattr(total, f.name, getattr(total, f.name) + getattr(stats, f.name))
        return total

    # ---- grpc.health.v1.Health ------------------------------------------------------------
    async def Check(self, request: health_pb2.HealthCheckRequest, grpc_context: Any
                    ) -> health_pb2.HealthCheckResponse:
        if request.service not in ("", *SERVICE_NAMES):
            grpc_context.set_code(grpc.StatusCode.NOT_FOUND)
            grpc_context.set_details(f"unknown service {request.service!r}")
            return health_pb2.HealthCheckResponse()
        try:
            self.joined = len(await self.follower.registry.live_members.remote())
        except RayActorError:  # the registry restarting: its last answer stands
            pass
        serving = self.state.phase is Phase.SERVING and self.joined >= self.config.min_replicas
        status = health_pb2.HealthCheckResponse.SERVING if serving else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, grpc_context: Any
                    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        grpc_context.set_code(grpc.StatusCode.UNIMPLEMENTED)
        grpc_context.set_details("Health/Watch is not served through Ray Serve's gRPC proxy; "
                                 "poll Health/Check")
        raise StreamAborted(grpc_context.details())
        yield  # pragma: no cover - makes this an async generator

    # ---- Ray Serve hooks and broadcast targets -------------------------------------------
    def check_health(self) -> None:
        """Ray calls it periodically; raising makes Ray replace this replica."""
        engine = self.state.engine
        if self.state.phase is Phase.DEAD or engine is None or not engine.alive:
            raise RuntimeError(f"replica {self.replica_id}: the engine loop has stopped "
                               f"({engine.error if engine else 'no engine'!r})")

    async def local_tiers(self) -> tuple[str, dict[str, tuple[str, int]]]:
        infos = await list_adapters(self.state, while_draining=True)
        return self.replica_id, local_tiers(infos, self.follower.failures)

    async def local_stats(self) -> pb.GetStatsResponse:
        return await self.info.GetStats(pb.GetStatsRequest(), None)

    async def local_metrics(self) -> tuple[str, bytes]:
        return self.replica_id, await local_exposition(self.state)

    async def _cluster_exposition(self) -> bytes:
        return merge_expositions(sorted(await self._broadcast("local_metrics")))

    async def _replica_tiers(self) -> ReplicaTiers:
        return dict(await self._broadcast("local_tiers"))

    async def _broadcast(self, method: str) -> list[Any]:
        ctx = serve.get_replica_context()
        handle = serve.get_deployment_handle(ctx.deployment, ctx.app_name)
        results = await handle.broadcast(method).results_async(
            timeout_s=BROADCAST_TIMEOUT_S, return_exceptions=True)
        return [r for r in results if not isinstance(r, BaseException)]

    async def __del__(self) -> None:
        """Serve calls it when it stops the replica: leave the registry, drain, stop."""
        if hasattr(self, "follower"):
            await self.follower.leave()
        if hasattr(self, "server"):
            await self.server.stop(grace=self.options.shutdown_grace_s)


def deployment_class(max_adapters_per_replica: int) -> type:
    """LoraplexReplica with its ``@serve.multiplexed`` method (the limit is fixed when the
    class is made, as Ray reads it from the class), and the HTTP front as its ASGI ingress
    (built per replica by ``__serve_build_asgi_app__``)."""

    @serve.ingress()
    class LoraplexDeployment(LoraplexReplica):
        @serve.multiplexed(max_num_models_per_replica=max_adapters_per_replica)
        async def hold_adapter(self, name: str) -> str:
            return await self._check_adapter(name)

    return LoraplexDeployment
