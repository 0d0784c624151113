"""``loraplex serve``: its flags (config.py's ServeConfig, derived by config_flags.py: vLLM's
names), their checks (a usage error names what is wrong, before the model loads), and the
hand-off of the one ServeConfig to server/ (one process) or server/ray/ (``--ray``: replicas
on Ray Serve, which is imported only then)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from .config import ServeConfig
from .config_flags import add_flags, byte_size, from_args, lora_module, max_loras_arg

__all__ = ["add_serve", "byte_size", "check_model_arg", "demo_adapters_dir", "lora_module",
           "max_loras_arg", "run_serve", "serve_config"]
log = logging.getLogger("loraplex")


def add_serve(sub: argparse._SubParsersAction) -> None:
    """``serve``'s flags: ServeConfig's tree (engine, server, Ray), nothing by hand."""
    p = sub.add_parser("serve", help="serve a base model and LoRA adapters over gRPC (and "
                       "OpenAI-compatible HTTP with --http-port)")
    add_flags(p, ServeConfig)
    p.set_defaults(handler=run_serve, command_parser=p)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The one ServeConfig of a ``serve`` command line, checked (ValueError: a usage error)
    before anything loads; without --model the demo adapters come first."""
    from .server.lora_modules import check_servable, demo_adapters, lora_modules_dict

    modules = lora_modules_dict(args.lora_modules)
    if args.model is None:
        modules = {**demo_adapters(demo_adapters_dir()), **modules}
    check_model_arg(args.model)
    check_servable(modules)
    config: ServeConfig = from_args(ServeConfig, args, lora_modules=modules)
    if config.ray is not None:
        try:
            from .server.ray import launch  # noqa: F401 - imports ray
        except ImportError as e:
            raise ValueError(f"--ray needs Ray Serve: pip install 'loraplex[ray]' ({e})"
                             ) from None
    return config


def run_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check every flag (usage errors name what is wrong) before the model loads, then serve."""
    try:
        config = serve_config(args)
    except ValueError as e:
        parser.error(str(e))
    setup_logging(config.log_level)
    if args.model is None:
        warn_if_no_demo_adapters()
    if config.ray is not None:
        return _serve_ray(config)
    return _serve(config)


def demo_adapters_dir() -> Path:
    """``adapters/`` of the installed package: package data in the wheel (pyproject.toml),
    the checkout's own folder in an editable install."""
    return Path(str(resources.files("loraplex") / "adapters"))


def warn_if_no_demo_adapters() -> None:
    """Without --model the demo adapters are expected: their absence is a warning, not silence."""
    from .server.lora_modules import demo_adapters

    folder = demo_adapters_dir()
    if not demo_adapters(folder):
        log.warning("no demo adapters in %s (missing from this install): serving the embedded "
                    "model without them; register adapters with --lora-modules NAME=PATH",
                    folder)


def _serve(config: ServeConfig) -> int:
    from .server import serve

    def load() -> Any:
        from .engine.llm_engine import LLMEngine

        return LLMEngine.from_config(config.engine, progress=True)

    try:
        asyncio.run(serve(config.server, load))
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a failed start is one line and exit 1
        return _start_failed("loraplex serve", e)
    return 0


def _serve_ray(config: ServeConfig) -> int:
    from .server.ray.launch import serve_ray

    assert config.ray is not None
    try:
        serve_ray(config.server, config.ray, config.engine)
    except Exception as e:  # noqa: BLE001 - a failed start is one line and exit 1
        return _start_failed("loraplex serve --ray", e)
    return 0


def _start_failed(command: str, e: Exception) -> int:
    """A failed start is one clear line (the traceback at DEBUG) and exit status 1."""
    log.debug("start-up failed", exc_info=e)
    log.error("%s failed: %s: %s", command, type(e).__name__, e)
    return 1


def check_model_arg(model: str | None) -> None:
    from .engine.embedded_model import DEFAULT_MODEL_ALIASES

    if model is not None and model not in DEFAULT_MODEL_ALIASES and not Path(model).is_dir() \
            and not (Path(model).is_file() and model.endswith(".gguf")):
        raise ValueError(f"--model {model!r} is not a directory; give a local Hugging Face "
                         f"model dir, a .gguf file or one of {', '.join(DEFAULT_MODEL_ALIASES)}")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
