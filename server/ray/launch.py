"""``loraplex serve --ray``: join or start a Ray cluster, create the adapter registry, deploy
the engine replicas behind Ray Serve's gRPC proxy on ``--port``, and tear it all down on
SIGTERM / SIGINT.

What Ray's proxy does not do, and what follows:

- it listens on every interface (``gRPCOptions`` has no host): ``--host`` applies to the
  HTTP proxy only;
- it has no TLS option: ``--ssl-*`` are refused; put a TLS-terminating proxy in front;
- it drops the client's deadline (``grpc-timeout``): a deadline still ends the call, as the
  client cancels it when it passes, and the cancel reaches the engine;
- Serve's HTTP proxy serves the OpenAI-compatible front (server/http, on every replica) on
  ``--host``:``--http-port``; without ``--http-port`` it still starts, bound to 127.0.0.1 on
  a free port.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import ray
import torch
from ray import serve
from ray.serve.config import HTTPOptions, gRPCOptions

from ...engine.engine_config import EngineConfig
from ...kernel_backends import backend_name
from ..adapter_paths import path_loading_warning
from ..server_options import ServerOptions
from .deployment import ReplicaConfig, deployment_class
from .ray_options import RayOptions
from .registry import AdapterRegistry
from .registry_store import GcsStore
from .shutdown import Shutdown

log = logging.getLogger(__name__)

NAMESPACE = "loraplex"
# Ray sends a replica up to max_queue + this many calls, so that loraplex's own admission
# answers RESOURCE_EXHAUSTED beyond --max-queue (as one server does) and admin, health and
# broadcast calls still get through to a full replica.
ADMIN_HEADROOM = 8
TEARDOWN_S = 15.0  # beyond the grace period, for Serve and Ray to stop
BACKSTOP_S = 5.0  # beyond both: the hard exit when even the teardown's watchdog is stuck
SERVICER_FUNCTIONS = [
    "loraplex.proto.loraplex_pb2_grpc.add_InferenceServicer_to_server",
    "loraplex.proto.loraplex_pb2_grpc.add_AdapterAdminServicer_to_server",
    "loraplex.proto.loraplex_pb2_grpc.add_ServerInfoServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
]


def registry_name(app_name: str) -> str:
    return f"{app_name}-adapter-registry"


def start_ray(ray_options: RayOptions) -> float:
    """Join ``address`` or start a local cluster (no dashboard); the seconds it took."""
    start = time.perf_counter()
    if not ray.is_initialized():
        kw: dict[str, Any] = {"namespace": NAMESPACE, "include_dashboard": False,
                              "log_to_driver": True}
        if ray_options.address is None and ray_options.num_cpus is not None:
            kw["num_cpus"] = ray_options.num_cpus
        ray.init(address=ray_options.address, **kw)
    return time.perf_counter() - start


def _replica_gpus(ray_options: RayOptions, device: str) -> float:
    if ray_options.replica_gpus is not None:
        return ray_options.replica_gpus
    return 1.0 if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else 0.0


def _prebuild_kernels(device: str, gpus: float) -> None:
    """Build (or find) the CPU kernels here once, so that replicas on this machine load the
    cached build instead of each compiling it (minutes)."""
    if gpus == 0 and device in ("cpu", "auto"):
        backend_name(torch.device("cpu"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_config(options: ServerOptions, ray_options: RayOptions, engine: EngineConfig
                   ) -> ReplicaConfig:
    """What every replica is built from: the command's one EngineConfig, as it was given."""
    return ReplicaConfig(engine, options, registry_name(ray_options.app_name), NAMESPACE,
                         ray_options.serving_replicas)


def deploy(options: ServerOptions, ray_options: RayOptions, engine: EngineConfig) -> Any:
    """Create the registry (seeded with ``engine.lora_modules``) and run the deployment behind
    the gRPC proxy on ``options.port`` (and the HTTP one on ``options.http_port``); returns
    once every replica is up (warmed up, holding every adapter). Needs ``start_ray`` first."""
    if options.tls:
        raise ValueError("--ssl-* cannot be used with --ray: Ray Serve's gRPC proxy has no "
                         "TLS; terminate TLS in a proxy in front of it")
    gpus = _replica_gpus(ray_options, engine.device)
    _prebuild_kernels(engine.device, gpus)
    config = replica_config(options, ray_options, engine)
    name = config.registry_name
    _kill_registry(name)
    # Ray restarts the registry if its process dies; it resumes from the store.
    ray.remote(AdapterRegistry).options(
        name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0,
        max_concurrency=1000, max_restarts=-1).remote(config.lora_modules, store=GcsStore(name))
    http = (HTTPOptions(host=options.host, port=options.http_port)
            if options.http_port is not None else
            HTTPOptions(host="127.0.0.1", port=_free_port()))
    serve.start(http_options=http,
                grpc_options=gRPCOptions(port=options.port,
                                         grpc_servicer_functions=SERVICER_FUNCTIONS,
                                         enable_reflection=True))
    # a replica reports holding up to its host tier's size of adapters to Ray's routing
    cls = deployment_class(engine.host_loras)
    deployment = serve.deployment(cls, name="LoraplexDeployment").options(
        **ray_options.deployment_options(options.max_queue + ADMIN_HEADROOM,
                                         engine.max_num_seqs, gpus))
    return serve.run(deployment.bind(config), name=ray_options.app_name)


def _kill_registry(name: str) -> None:
    """Stop the registry for good and forget its saved state."""
    try:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE))
    except ValueError:  # none yet
        pass
    GcsStore(name).clear()


def teardown(ray_options: RayOptions) -> None:
    """Delete the app and its registry; shut down Serve and Ray if this process started
    the cluster."""
    try:
        serve.delete(ray_options.app_name)
    finally:
        _kill_registry(registry_name(ray_options.app_name))
        if ray_options.address is None:
            serve.shutdown()
            ray.shutdown()


def serve_ray(options: ServerOptions, ray_options: RayOptions, engine: EngineConfig) -> None:
    """Run until SIGTERM or SIGINT (handlers installed after ``ray.init``, which replaces
    Python's), then tear down. A signal that comes while the deployment is still starting
    interrupts it; the process exits within the grace period + ``TEARDOWN_S`` either way."""
    took = start_ray(ray_options)
    log.info("Ray %s in %.1fs", "joined" if ray_options.address else "started", took)
    budget_s = options.shutdown_grace_s + TEARDOWN_S
    shutdown = Shutdown(budget_s + BACKSTOP_S)
    shutdown.install()
    try:
        with shutdown.interruptible():
            deploy(options, ray_options, engine)
        log.info("listening on 0.0.0.0:%d (Ray Serve gRPC proxy, every interface; --host "
                 "is not honoured there)", options.port)
        if options.http_port is not None:
            log.info("OpenAI-compatible HTTP on %s:%d (Ray Serve HTTP proxy)", options.host,
                     options.http_port)
        warning = path_loading_warning(options, exposed=True)  # the gRPC proxy: everywhere
        if warning is not None:
            log.warning("%s", warning)
        shutdown.wait()
    except KeyboardInterrupt:
        if not shutdown.requested:
            raise
        log.info("stopped while starting")
    finally:
        _teardown_within(ray_options, budget_s)


def _teardown_within(ray_options: RayOptions, seconds: float) -> None:
    """``teardown``, given up after ``seconds``: when the cluster's own processes got the
    signal too (a supervisor that signals the whole process group or cgroup), Ray's calls
    would wait on a dead controller forever."""
    worker = threading.Thread(target=teardown, args=(ray_options,), daemon=True,
                              name="loraplex-ray-teardown")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        log.warning("Ray did not finish the teardown within %.0fs (were its processes "
                    "stopped too?); exiting without it", seconds)
        os._exit(1)
