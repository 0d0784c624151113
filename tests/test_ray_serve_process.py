"""``loraplex serve --ray`` as a user runs it: one process that starts a local Ray cluster,
serves gRPC and OpenAI HTTP through Ray's proxies, and stops on SIGTERM: cleanly (exit 0,
Ray's processes gone) when the signal reaches it alone, and within its grace period +
``TEARDOWN_S`` + ``BACKSTOP_S`` when a supervisor signals the whole process group, Ray's own
processes with it, also while the deployment is still starting. Collected after
tests/server/ray_serve, whose cluster is down by then."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from loraplex.client import Client

from tests.conftest import make_adapter

GRACE_S = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def popen_serve_ray(tiny_llama: Path, adapter: Path, port: int, log: Path, *flags: str
                    ) -> subprocess.Popen:
    """``loraplex serve --ray`` as a child in its own session (so that its process group can
    be signalled): the tiny model in float32 on CPU, launch adapter ``a``, gRPC on ``port``,
    output to ``log``; ``flags`` say the replicas and the rest."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "loraplex.cli", "serve", "--ray", "--model", str(tiny_llama),
             "--lora-modules", f"a={adapter}", "--port", str(port), "--dtype", "float32",
             "--device", "cpu", "--shutdown-grace-period", str(GRACE_S), *flags],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def start_serve(tiny_llama: Path, tmp_path: Path, log: Path) -> tuple[subprocess.Popen, int, int]:
    adapter = make_adapter(tiny_llama, tmp_path / "a", seed=3)
    port, http_port = free_port(), free_port()
    proc = popen_serve_ray(tiny_llama, adapter, port, log, "--num-replicas", "1",
                           "--replica-cpus", "1", "--http-port", str(http_port),
                           "--max-model-len", "128")
    return proc, port, http_port


def stop_within_bound(proc: subprocess.Popen, whole_group: bool, what: str) -> int:
    """SIGTERM to the process (or its group); its exit code, asserting the documented bound."""
    from loraplex.server.ray.launch import BACKSTOP_S, TEARDOWN_S

    start = time.monotonic()
    if whole_group:
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=GRACE_S + TEARDOWN_S + BACKSTOP_S + 30)
    took = time.monotonic() - start
    print(f"\n[ray] serve --ray stopped by SIGTERM to the "
          f"{'process group' if whole_group else 'process'} {what}: exit {code} in {took:.1f}s")
    assert took < GRACE_S + TEARDOWN_S + BACKSTOP_S + 10, took  # + faulthandler's stack dump
    return code


def kill_leftovers(proc: subprocess.Popen) -> None:
    if proc.poll() is None or group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


# the process group's stops (while serving, and while the deployment starts, below) run under
# -m slow (`make test-slow`): each is a Ray cluster, ~40 s on 2 cores, of which the stop while
# starting spends 16 s in the teardown's watchdog; `make test` keeps the process's own stop
@pytest.mark.parametrize("whole_group", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["process", "process-group"])
def test_serve_ray_process_serves_and_stops(tiny_llama: Path, tmp_path: Path,
                                            whole_group: bool) -> None:
    log = tmp_path / "serve.log"
    proc, port, http_port = start_serve(tiny_llama, tmp_path, log)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            client.wait_until_serving(180)
            reply = client.generate(prompt_token_ids=[5, 6, 7], adapter="a", temperature=0.0,
                                    max_new_tokens=4, ignore_eos=True)
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=60, json={
            "model": "a", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.0,
            "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reply.text
        code = stop_within_bound(proc, whole_group, "while serving")
        if not whole_group:
            assert code == 0, log.read_text()[-3000:]
            deadline = time.monotonic() + 20
            while group_alive(proc.pid):  # Ray's processes leave with it
                assert time.monotonic() < deadline, "Ray's processes outlived the server"
                time.sleep(0.5)
    finally:
        kill_leftovers(proc)


@pytest.mark.slow
def test_serve_ray_process_stops_while_the_deployment_starts(tiny_llama: Path,
                                                             tmp_path: Path) -> None:
    """The signal reaches the group while ``serve.run`` still waits for the replica (the
    case that hung before: the controller died under it and the wait never returned)."""
    log = tmp_path / "serve.log"
    proc, _, _ = start_serve(tiny_llama, tmp_path, log)
    try:
        deadline = time.monotonic() + 180
        while "Adding 1 replica" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        stop_within_bound(proc, True, "while starting")
    finally:
        kill_leftovers(proc)
