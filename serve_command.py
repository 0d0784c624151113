"""``loraplex serve``: its flags (vLLM's names), their checks (a usage error names what is
wrong, before the model loads), and the hand-off to server/ (one process) or
server/ray/ (``--ray``: replicas on Ray Serve, which is imported only then)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

from .server.lora_modules import parse_lora_module
from .server.options import DEFAULT_GRACE_S, DEFAULT_HOST, DEFAULT_MAX_QUEUE, DEFAULT_PORT

PACKAGE_DIR = Path(__file__).resolve().parent
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def byte_size(text: str) -> int:
    """``4294967296``, ``4GiB``, ``512MB`` -> bytes."""
    number = text.strip().rstrip("bBiIkKmMgG")
    unit = text.strip()[len(number):].lower()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes, or a number with KB, MB, GB, KiB, MiB, GiB"
        ) from None
    return int(value)


def max_loras_arg(text: str) -> int | str:
    """``auto`` or a positive integer."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor a positive integer")
    return value


def lora_module(text: str) -> Any:
    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a base model and LoRA adapters over gRPC (and "
                       "OpenAI-compatible HTTP with --http-port)")
    p.add_argument("--model", help="local Hugging Face model dir (default: the embedded "
                                   "SmolLM2-135M-Instruct and the demo adapters)")
    p.add_argument("--served-model-name", help="alias requests may use for the base model")
    p.add_argument("--lora-modules", nargs="+", action="extend", type=lora_module, default=[],
                   metavar="NAME=PATH", help='adapters loaded at start: name=path or '
                   '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
    cap = p.add_argument_group("capacity")
    cap.add_argument("--max-loras", type=max_loras_arg, default="auto",
                     help="adapters on the device at once: 'auto' (default: as many as "
                          "--lora-memory holds, at most --max-num-seqs) or N (vLLM's meaning)")
    cap.add_argument("--lora-memory", type=byte_size, metavar="BYTES",
                     help="device memory for adapters with --max-loras auto (e.g. 512MiB); "
                          "default: 10%% of what is left after weights and a minimum KV cache")
    cap.add_argument("--max-lora-rank", type=int, default=64)
    cap.add_argument("--max-adapter-reads", type=int, default=4,
                     help="adapter reads from disk at once, ahead of the queue")
    cap.add_argument("--max-cpu-loras", type=int, help="adapters in host memory (default: 2×max-loras; "
                     "2×max-num-seqs with auto)")
    cap.add_argument("--max-num-seqs", type=int, default=32, help="requests running in a step")
    cap.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                     help="requests in flight (waiting + running); RESOURCE_EXHAUSTED beyond")
    cap.add_argument("--max-num-batched-tokens", type=int, default=512,
                     help="token budget per step")
    cap.add_argument("--max-model-len", type=int, help="default: the model's limit")
    cap.add_argument("--kv-cache-memory", type=byte_size, metavar="BYTES",
                     help="KV-cache size (e.g. 4GiB); default: --gpu-memory-utilization")
    cap.add_argument("--gpu-memory-utilization", type=float, default=0.92,
                     help="fraction of device memory for weights + KV cache (CUDA only)")
    cap.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    cap.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                     default="auto")
    cap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    net = p.add_argument_group("network and security")
    net.add_argument("--host", default=DEFAULT_HOST)
    net.add_argument("--port", type=int, default=DEFAULT_PORT)
    net.add_argument("--http-port", type=int, metavar="PORT",
                     help="also serve vLLM's OpenAI-compatible HTTP API and /metrics on PORT "
                     "(same process, engine, tokens and TLS; off unless given)")
    net.add_argument("--api-token", default=os.environ.get("LORAPLEX_API_TOKEN"),
                     help="require it on Inference/ServerInfo (env LORAPLEX_API_TOKEN)")
    net.add_argument("--admin-token", default=os.environ.get("LORAPLEX_ADMIN_TOKEN"),
                     help="require it on AdapterAdmin (env LORAPLEX_ADMIN_TOKEN)")
    net.add_argument("--adapter-root", action="append", default=[], type=Path, metavar="DIR",
                     help="LoadAdapter paths must lie under one of these (repeatable)")
    net.add_argument("--ssl-certfile", type=Path)
    net.add_argument("--ssl-keyfile", type=Path)
    net.add_argument("--ssl-ca-certs", type=Path, help="require client certs it signed (mTLS)")
    net.add_argument("--shutdown-grace-period", type=float, default=DEFAULT_GRACE_S,
                     metavar="SECONDS", help="on SIGTERM, in-flight requests may finish within")
    _add_ray_flags(p)
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(handler=run_serve, command_parser=p)


def _add_ray_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray Serve scale-out (pip install loraplex[ray])")
    g.add_argument("--ray", action="store_true",
                   help="serve engine replicas on Ray Serve behind its gRPC proxy on --port "
                   "(which listens on every interface: --host applies to --http-port only; "
                   "no TLS)")
    g.add_argument("--ray-address", metavar="ADDRESS",
                   help="join this Ray cluster ('auto': the one `ray start` began here); "
                   "default: start a local one")
    g.add_argument("--num-replicas", type=int, help="fixed number of replicas (default 1)")
    g.add_argument("--min-replicas", type=int, help="autoscaling: at least this many")
    g.add_argument("--max-replicas", type=int, help="autoscaling: at most this many")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica")
    g.add_argument("--replica-gpus", type=float,
                   help="GPUs per replica (default: 1 on CUDA, 0 on CPU)")


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check every flag (usage errors name what is wrong) before the model loads, then serve."""
    from .engine.config import EngineConfig
    from .server import ServerOptions, serve
    from .server.lora_modules import check_servable, demo_adapters, lora_modules_dict

    try:
        modules = lora_modules_dict(args.lora_modules)
        if args.model is None:
            modules = {**demo_adapters(PACKAGE_DIR / "adapters"), **modules}
        check_model_arg(args.model)
        check_servable(modules)
        engine_kw = _engine_kwargs(args, modules)
        EngineConfig(model=args.model, **engine_kw)  # validates the knobs now
        options = ServerOptions(
            host=args.host, port=args.port, http_port=args.http_port,
            max_queue=args.max_queue, api_token=args.api_token,
            admin_token=args.admin_token, adapter_roots=args.adapter_root,
            ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
            ssl_ca_certs=args.ssl_ca_certs, shutdown_grace_s=args.shutdown_grace_period,
            served_model_name=args.served_model_name)
        _check_ray_only(args)
        ray_options = _ray_options(args) if args.ray else None
    except ValueError as e:
        parser.error(str(e))
    setup_logging(args.log_level)
    if ray_options is not None:
        return _serve_ray(args, options, ray_options, engine_kw)

    def load() -> Any:
        from .engine.llm_engine import LLMEngine

        return LLMEngine(args.model, progress=True, **engine_kw)

    try:
        asyncio.run(serve(options, load))
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a failed start is one line and exit 1
        return _start_failed("loraplex serve", e)
    return 0


_RAY_ONLY = ("ray_address", "num_replicas", "min_replicas", "max_replicas", "replica_gpus")


def _check_ray_only(args: argparse.Namespace) -> None:
    given = [f"--{n.replace('_', '-')}" for n in _RAY_ONLY if getattr(args, n) is not None]
    if given and not args.ray:
        raise ValueError(f"{', '.join(given)} only apply with --ray")


def _ray_options(args: argparse.Namespace) -> Any:
    """RayOptions from the flags (imports ray: only with --ray)."""
    try:
        from .server.ray.launch import RayOptions
    except ImportError as e:
        raise ValueError(f"--ray needs Ray Serve: pip install 'loraplex[ray]' ({e})") from None
    return RayOptions(address=args.ray_address, num_replicas=args.num_replicas,
                      min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                      replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus)


def _serve_ray(args: argparse.Namespace, options: Any, ray_options: Any,
               engine_kw: dict[str, Any]) -> int:
    from .server.ray.launch import serve_ray

    modules = engine_kw.pop("lora_modules")
    try:
        serve_ray(options, ray_options, args.model, engine_kw, modules)
    except Exception as e:  # noqa: BLE001 - a failed start is one line and exit 1
        return _start_failed("loraplex serve --ray", e)
    return 0


def _start_failed(command: str, e: Exception) -> int:
    """A failed start is one clear line (the traceback at DEBUG) and exit status 1."""
    log = logging.getLogger("loraplex")
    log.debug("start-up failed", exc_info=e)
    log.error("%s failed: %s: %s", command, type(e).__name__, e)
    return 1


def check_model_arg(model: str | None) -> None:
    from .engine.models.embedded import DEFAULT_MODEL_ALIASES

    if model is not None and model not in DEFAULT_MODEL_ALIASES and not Path(model).is_dir():
        raise ValueError(f"--model {model!r} is not a directory; give a local Hugging Face "
                         f"model dir or one of {', '.join(DEFAULT_MODEL_ALIASES)}")


def _engine_kwargs(args: argparse.Namespace, modules: dict[str, str]) -> dict[str, Any]:
    return {
        "dtype": args.dtype, "device": args.device, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
        "block_size": args.block_size, "kv_cache_memory": args.kv_cache_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization, "max_loras": args.max_loras,
        "lora_memory": args.lora_memory, "max_adapter_reads": args.max_adapter_reads,
        "max_lora_rank": args.max_lora_rank, "max_cpu_loras": args.max_cpu_loras,
        "lora_modules": modules, "served_model_name": args.served_model_name}


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
