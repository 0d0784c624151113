"""Fixtures for the gRPC server tests: a real server on 127.0.0.1 (port 0) around a tiny
model, running its grpc.aio loop on a background thread; tests talk to it with the real
clients."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from loraplex import LLMEngine
from loraplex.client import Client
from loraplex.server import LoraplexServer, ServerOptions


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0,
               what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def launch_serve(cmd: list[str], log_path: Path,
                 timeout: float = 90.0) -> tuple[subprocess.Popen, int]:
    """Start a ``loraplex serve`` process (output to ``log_path``); its port once listening
    (within ``timeout`` seconds)."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_until(lambda: "listening on" in log_path.read_text() or proc.poll() is not None,
                   timeout=timeout, what="listening")
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", log_path.read_text())[1])
    except BaseException:
        proc.kill()
        raise
    return proc, port


@contextmanager
def slow_steps(engine: LLMEngine, seconds: float) -> Iterator[None]:
    """Every engine step of ``engine`` sleeps ``seconds`` first, so that a request is
    surely still running while a test looks at it (the engine loop looks ``step`` up on
    each turn, so this takes effect at the next step)."""
    step = engine.step

    def slow() -> Any:
        time.sleep(seconds)
        return step()

    engine.step = slow  # type: ignore[method-assign]
    try:
        yield
    finally:
        del engine.step


# max_lora_rank 16 (the engine's default is 64, as serve's): the bad-input cases load a
# rank-32 adapter to see it refused
ENGINE_KW = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "max_num_seqs": 32,
             "max_num_batched_tokens": 256, "max_lora_rank": 16}


def tiny_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    return LLMEngine(model_dir, **{**ENGINE_KW, **overrides})


class RunningServer:
    """A LoraplexServer on its own event-loop thread, started, loaded and SERVING."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], load: bool = True,
                 **options: Any):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-grpc-loop",
                                       daemon=True)
        self.thread.start()
        self.options = ServerOptions(host="127.0.0.1", port=0, **options)
        self.server = LoraplexServer(self.options, engine)
        self.port = self.call(self.server.start())
        self.stopped = False
        if load:
            self.call(self.server.load())

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """The HTTP front's base URL (start with ``http_port=0``)."""
        assert self.server.http_port is not None, "started without http_port"
        return f"http://127.0.0.1:{self.server.http_port}"

    @property
    def engine(self) -> LLMEngine:
        assert self.server.state.engine is not None
        return self.server.state.engine.engine

    def submit(self, coro: Coroutine[Any, Any, Any]) -> Future:
        """Run ``coro`` on the server's loop; its concurrent Future (does not wait)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 120.0) -> Any:
        return self.submit(coro).result(timeout)

    def client(self, **options: Any) -> Client:
        return Client(self.target, **options)

    def stop(self, grace: float = 0.0) -> None:
        if self.loop.is_closed():
            return
        if not self.stopped:
            self.stopped = True
            self.call(self.server.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="session")
def make_engine() -> Callable[..., LLMEngine]:
    """make_engine(model_dir, **LLMEngine overrides) -> a tiny CPU engine (tests/ is not a
    package, so helpers reach test files as fixtures)."""
    return tiny_engine


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[..., RunningServer]]:
    """serve(engine, load=True, **ServerOptions fields) -> a RunningServer (SERVING unless
    ``load`` is False), stopped after the module."""
    servers: list[RunningServer] = []

    def start(engine: LLMEngine | Callable[[], LLMEngine], load: bool = True,
              **options: Any) -> RunningServer:
        servers.append(RunningServer(engine, load, **options))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def _root_conftest() -> ModuleType:
    """tests/conftest.py as a module (tests/ is not a package), for ``make_adapter``."""
    path = Path(__file__).resolve().parents[1] / "conftest.py"
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) and Path(module.__file__).resolve() == path:
            return module
    spec = importlib.util.spec_from_file_location("_loraplex_tests_conftest", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def make_adapter_dir() -> Callable[..., Path]:
    """tests/conftest.py's make_adapter(base_dir, out_dir, r=..., ...)."""
    return _root_conftest().make_adapter


@pytest.fixture(scope="session")
def tiny_adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory,
                  make_adapter_dir: Callable[..., Path]) -> Callable[[str], Path]:
    """tiny_adapters(name) -> a real PEFT adapter for tiny_llama, made once per session.
    Names ``a0``..``a9`` differ in seed, rank and target modules."""
    make_adapter = make_adapter_dir
    root = tmp_path_factory.mktemp("server_adapters")
    made: dict[str, Path] = {}
    targets = [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"),
               ("gate_proj", "up_proj", "down_proj")]

    def get(name: str) -> Path:
        if name not in made:
            i = sum(map(ord, name))
            made[name] = make_adapter(tiny_llama, root / name, r=4 + 4 * (i % 3),
                                      target_modules=targets[i % 3], seed=i)
        return made[name]

    return get
