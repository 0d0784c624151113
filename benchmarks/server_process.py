"""A ``loraplex serve`` subprocess for the benchmarks that start their own servers (so the
load client does not share the server's GIL)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..client import Client

START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model_dir: Path, port: int, adapters: Mapping[str, Path],
                  flags: Sequence[str]) -> list[str]:
    """The command line: every adapter registered at start through ``--lora-modules``."""
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(model_dir),
           "--port", str(port), "--log-level", "WARNING", *flags]
    if adapters:
        cmd += ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    return cmd


@contextmanager
def served(model_dir: Path, adapters: Mapping[str, Path], log_path: Path,
           flags: Sequence[str] = ()) -> Iterator[str]:
    """``loraplex serve`` with ``flags``, SERVING on a free port; SIGTERM and wait on exit.
    Yields HOST:PORT. The server's output is appended to ``log_path``."""
    with served_process(model_dir, adapters, log_path, flags) as (target, _):
        yield target


@contextmanager
def served_process(model_dir: Path, adapters: Mapping[str, Path], log_path: Path,
                   flags: Sequence[str] = ()) -> Iterator[tuple[str, int]]:
    """As ``served``; yields (HOST:PORT, the server's pid)."""
    port = free_port()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(serve_command(model_dir, port, adapters, flags), stdout=log,
                                stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{port}"
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
