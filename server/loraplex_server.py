"""LoraplexServer: the grpc.aio server (and, with ``--http-port``, the OpenAI-compatible
HTTP front in the same event loop) around one AsyncEngine, from start-up to shutdown.

Life cycle: ``start`` binds the port with health NOT_SERVING (phase STARTING, generate calls
get UNAVAILABLE); ``load`` builds the engine off the event loop, starts its thread, warms it
up with one tiny generate and only then turns health SERVING; ``stop`` turns health
NOT_SERVING, refuses new calls, lets in-flight ones finish within the grace period, cancels
the rest (which aborts them in the engine) and stops the engine thread. Both fronts share
the ServerState: one phase, one ``--max-queue`` count, one set of metrics.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from contextlib import aclosing
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health as health_mod
from grpc_health.v1 import health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..engine.async_engine import AsyncEngine
from ..engine.llm_engine import LLMEngine
from ..engine.sampling_params import SamplingParams
from ..errors import EngineDeadError
from ..proto import loraplex_pb2_grpc as pb_grpc
from .adapter_paths import path_loading_warning
from .adapter_resolver import attach_resolver
from .description import describe
from .grpc.adapter_admin import AdapterAdminServicer
from .grpc.auth_interceptor import TokenAuthInterceptor
from .grpc.health import SERVICE_NAMES, PhaseHealth
from .grpc.inference import InferenceServicer
from .grpc.server_info import ServerInfoServicer
from .server_options import ServerOptions
from .state import Phase, ServerState

if TYPE_CHECKING:
    from .http.server import HttpServer

log = logging.getLogger(__name__)

EngineSource = LLMEngine | Callable[[], LLMEngine]


class LoraplexServer:
    def __init__(self, options: ServerOptions, engine: EngineSource,
                 exposed: bool | None = None):
        """``exposed``: reachable beyond loopback (default: unless ``--host`` is loopback;
        a Ray replica is, behind a proxy on every interface)."""
        self.options = options
        self.state = ServerState(options, exposed)
        self.health = PhaseHealth()  # grpc.health.v1, following the phase
        self.state.phase_observers.append(self.health.follow)
        self._engine_source = engine
        self._server: grpc.aio.Server | None = None
        self.http: HttpServer | None = None  # the OpenAI-compatible front, with --http-port
        self.port: int | None = None

    # ---- start-up -----------------------------------------------------------------------
    async def start(self) -> int:
        """Bind and start listening (health NOT_SERVING until ``load``); the bound port."""
        options = self.options
        interceptors = []
        if options.api_token is not None or options.admin_token is not None:
            interceptors.append(TokenAuthInterceptor(options.api_token, options.admin_token))
        # gRPC refuses a larger message with RESOURCE_EXHAUSTED before parsing it
        server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", options.max_request_bytes)])
        pb_grpc.add_InferenceServicer_to_server(InferenceServicer(self.state), server)
        pb_grpc.add_AdapterAdminServicer_to_server(AdapterAdminServicer(self.state), server)
        pb_grpc.add_ServerInfoServicer_to_server(ServerInfoServicer(self.state), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health_mod.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self.port = _bind(server, options)
        await self.state.set_phase(Phase.STARTING)
        await server.start()
        self._server = server
        log.info("listening on %s:%d (%s)", options.host, self.port,
                 "mutual TLS" if options.ssl_ca_certs else "TLS" if options.tls else "plaintext")
        warning = path_loading_warning(options, self.state.exposed)
        if warning is not None:
            log.warning("%s", warning)
        if options.http_port is not None:
            await self._start_http()
        return self.port

    async def _start_http(self) -> None:
        from .http.server import HttpServer  # FastAPI and uvicorn load only when asked for

        self.http = HttpServer(self.state, self.options)
        port = await self.http.start()
        scheme = "https" if self.options.tls else "http"
        log.info("OpenAI-compatible HTTP on %s://%s:%d/v1 (metrics at /metrics)", scheme,
                 self.options.host, port)

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    async def load(self) -> None:
        """Build the engine (off the event loop), start its thread, warm up, then SERVING."""
        source = self._engine_source
        if isinstance(source, LLMEngine):
            async_engine = AsyncEngine(source)
        else:  # built on its own thread, which then steps it (kernel_backends/intra_op.py)
            async_engine = await AsyncEngine.build(source)
        engine = async_engine.engine
        self.state.attach(async_engine)
        attach_resolver(self.state)
        async_engine.start()
        if self.options.warmup:
            await _warm_up(async_engine)
        _log_capacity(engine, self.options)
        await self.state.set_phase(Phase.SERVING)

    # ---- shutdown -----------------------------------------------------------------------
    async def stop(self, grace: float | None = None) -> None:
        """Drain: refuse new calls, give in-flight ones ``grace`` seconds, then cancel them."""
        grace = self.options.shutdown_grace_s if grace is None else grace
        if self.state.phase is not Phase.DEAD:
            await self.state.set_phase(Phase.DRAINING)
        await self.health.servicer.enter_graceful_shutdown()
        log.info("draining: %d requests in flight, grace %.1fs", self.state.in_flight, grace)
        fronts = [f.stop(grace) for f in (self._server, self.http) if f is not None]
        await asyncio.gather(*fronts)  # both fronts drain at once, within the same grace
        if self.state.engine is not None:
            await asyncio.to_thread(self.state.engine.shutdown)
        log.info("stopped")

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


def server_credentials(options: ServerOptions) -> grpc.ServerCredentials | None:
    """TLS (--ssl-certfile/--ssl-keyfile) and mutual TLS (--ssl-ca-certs): None without TLS;
    with ``ssl_ca_certs`` clients must present a certificate it signed."""
    if options.ssl_certfile is None or options.ssl_keyfile is None:
        return None
    key = options.ssl_keyfile.read_bytes()
    cert = options.ssl_certfile.read_bytes()
    ca = options.ssl_ca_certs.read_bytes() if options.ssl_ca_certs is not None else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def _bind(server: grpc.aio.Server, options: ServerOptions) -> int:
    address = options.address
    credentials = server_credentials(options)
    try:
        port = (server.add_secure_port(address, credentials) if credentials is not None
                else server.add_insecure_port(address))
    except RuntimeError as e:
        raise OSError(f"cannot listen on {address}: {e}") from e
    if port == 0:
        raise OSError(f"cannot listen on {address} (is the port taken?)")
    return port


async def _warm_up(engine: AsyncEngine) -> None:
    """One tiny greedy generate through the whole path (tokens → step → stream)."""
    model = engine.engine
    first = model.base.hf_config.bos_token_id
    token = first if isinstance(first, int) else 0
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    async with aclosing(engine.generate([token], params, None, "loraplex-warmup")) as outputs:
        async for _ in outputs:
            pass


def _log_capacity(engine: LLMEngine, options: ServerOptions) -> None:
    info = describe(engine, options)
    knobs = ("max_num_seqs", "max_queue", "max_num_batched_tokens", "max_model_len",
             "kv_cache_tokens", "block_size", "kv_cache_memory", "gpu_memory_utilization",
             "max_loras", "max_lora_rank", "max_cpu_loras")
    log.info("serving %s (%s on %s%s)", info["model"], info["dtype"], info["device"],
             f", alias {info['served_model_name']!r}" if info["served_model_name"] else "")
    log.info("weights: %s", engine.base.weights.describe())
    log.info("capacity: %s", " ".join(f"{k}={info[k]}" for k in knobs))
    log.info("LoRA capacity: %s", info["lora_capacity"])
    log.info("memory: %s (on the CPU the pools commit pages as they are first written)",
             engine.memory_use().describe())


async def serve(options: ServerOptions, engine: EngineSource) -> None:
    """Run until SIGTERM or SIGINT, then drain; a second signal cancels in-flight calls now.
    If the engine loop dies, stop and raise EngineDeadError (the process exits non-zero
    instead of hanging on with health NOT_SERVING)."""
    server = LoraplexServer(options, engine)
    await server.start()
    stop = asyncio.Event()
    signals = _install_signal_handlers(stop, server)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        loading = asyncio.ensure_future(server.load())
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done():
            loading.result()  # a load failure ends serve with its error
            dying = asyncio.ensure_future(server.state.died.wait())
            await asyncio.wait({stopping, dying}, return_when=asyncio.FIRST_COMPLETED)
            dying.cancel()
            if server.state.phase is Phase.DEAD:
                error = server.state.engine.error if server.state.engine else None
                raise EngineDeadError(f"the engine loop died: {error!r}")
        else:
            loading.cancel()
    finally:
        stopping.cancel()
        await server.stop()
        for sig in signals:
            asyncio.get_running_loop().remove_signal_handler(sig)


def _install_signal_handlers(stop: asyncio.Event, server: LoraplexServer) -> list[int]:
    loop = asyncio.get_running_loop()
    installed = []

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("%s again: cancelling in-flight requests now", sig.name)
            if server._server is not None:
                asyncio.ensure_future(server._server.stop(0))
            if server.http is not None:
                server.http.cancel_now()
            return
        log.info("%s: draining (send it again to stop at once)", sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests), or Windows
            pass
    return installed


__all__ = ["LoraplexServer", "serve"]
