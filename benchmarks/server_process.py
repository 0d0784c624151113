"""A ``loraplex serve`` subprocess for the benchmarks that start their own servers (so the
load client does not share the server's GIL)."""

from __future__ import annotations

import dataclasses
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..client import Client
from ..config import ServeConfig
from ..config_flags import to_argv
from ..engine.engine_config import EngineConfig
from ..server.ray.ray_options import RayOptions
from ..server.server_options import ServerOptions

START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_config(model_dir: Path | None, adapters: Mapping[str, Path], *,
                 server: Mapping[str, Any] | None = None, ray: RayOptions | None = None,
                 log_level: str = "WARNING", flags: Sequence[str] = (),
                 **engine: Any) -> ServeConfig:
    """A benchmark's server as a ServeConfig: the command's defaults but for ``engine``
    (EngineConfig's fields), ``server`` (ServerOptions') and ``ray``, every adapter
    registered at start (``--lora-modules``; None for ``model_dir``: the embedded model and
    its demo adapters), logging at WARNING by default (the benchmark prints its own).
    ``flags``: more ``loraplex serve`` flags a user passed through, parsed by serve's own
    parser over the rest (a flag given there wins)."""
    modules = {n: str(Path(p).resolve()) for n, p in adapters.items()}
    config = ServeConfig(
        engine=EngineConfig(model=None if model_dir is None else str(model_dir), **engine,
                            lora_modules=modules),
        server=ServerOptions(**(server or {})), ray=ray, log_level=log_level)
    if flags:
        from ..cli import build_parser
        from ..serve_command import serve_config as parse_serve

        config = parse_serve(build_parser().parse_args(["serve", *to_argv(config), *flags]))
    return config


def serve_command(config: ServeConfig) -> list[str]:
    """``loraplex serve``'s command line for ``config``, in this interpreter."""
    return [sys.executable, "-m", "loraplex.cli", "serve", *to_argv(config)]


@contextmanager
def served(config: ServeConfig, log_path: Path) -> Iterator[str]:
    """``loraplex serve`` with ``config``, SERVING on a free port; SIGTERM and wait on exit.
    Yields HOST:PORT. The server's output is appended to ``log_path``."""
    with served_process(config, log_path) as (target, _):
        yield target


@contextmanager
def served_process(config: ServeConfig, log_path: Path) -> Iterator[tuple[str, int]]:
    """As ``served``; yields (HOST:PORT, the server's pid)."""
    config = dataclasses.replace(
        config, server=dataclasses.replace(config.server, port=free_port()))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(serve_command(config), stdout=log, stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{config.server.port}"
    try:
        with Client(target) as c:
            _wait_serving(c, proc, log_path)
        yield target, proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_serving(client: Client, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "".join(f"\n  {line}" for line in _last_lines(log_path, 5))
            raise RuntimeError(f"loraplex serve exited with {proc.returncode} (the end of "
                               f"{log_path}:{tail})")
        try:
            client.wait_until_serving(timeout=2.0)
            return
        except TimeoutError:
            continue
    raise RuntimeError(f"loraplex serve not SERVING after {START_TIMEOUT_S} s; see {log_path}")


def _last_lines(path: Path, count: int) -> list[str]:
    lines = path.read_text(errors="replace").replace("\r", "\n").splitlines()
    return [line for line in lines if line.strip()][-count:]
