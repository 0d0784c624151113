"""Runtime loading by path is an explicit choice (issue 42, as vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING): a server that listens beyond loopback reads adapter paths
only under --adapter-root, or anywhere with --allow-any-adapter-path; without either such
loads are PERMISSION_DENIED (uploads and the resolver are unaffected). A loopback server
(the default) loads any path. The rule, then a real `loraplex serve --host 0.0.0.0`."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from loraplex.client import Client
from loraplex.server.adapter_paths import (
    check_path_loading,
    is_loopback,
    path_loading_warning,
)
from loraplex.server.error_code import ServiceError
from loraplex.server.server_options import ServerOptions
from loraplex.server.state import ServerState

from tests.server.conftest import wait_until


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.1.2.3", False),
    ("no-such-host.invalid", False)])
def test_which_hosts_are_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    assert ServerState(ServerOptions(host=host)).exposed is not loopback


def test_the_rule(tmp_path: Path) -> None:
    plain, rooted = ServerOptions(), ServerOptions(adapter_roots=(tmp_path,))
    anywhere = ServerOptions(allow_any_adapter_path=True)
    for options in (plain, rooted, anywhere):  # loopback: every load by path as before
        check_path_loading(options, exposed=False)
        assert path_loading_warning(options, exposed=False) is None
    check_path_loading(rooted, exposed=True)
    check_path_loading(anywhere, exposed=True)
    with pytest.raises(ServiceError) as info:
        check_path_loading(plain, exposed=True)
    assert info.value.code.name == "PERMISSION_DENIED"
    assert "--adapter-root" in info.value.message
    assert "--allow-any-adapter-path" in info.value.message
    assert "is off" in path_loading_warning(plain, exposed=True)
    assert "ANY path" in path_loading_warning(anywhere, exposed=True)
    assert path_loading_warning(rooted, exposed=True) is None


@pytest.fixture(scope="module")
def exposed(serve, make_engine, tiny_llama: Path) -> Any:
    """A real server treated as reachable beyond loopback (the fixture binds 127.0.0.1)."""
    server = serve(lambda: make_engine(tiny_llama), http_port=0)
    server.server.state.exposed = True
    return server


def test_an_exposed_server_refuses_loads_by_path_on_both_fronts(exposed: Any,
                                                                tiny_adapters) -> None:
    path = str(tiny_adapters("p0"))
    with exposed.client() as client:
        with pytest.raises(grpc.RpcError) as info:
            client.load_adapter("p0", path)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "--allow-any-adapter-path" in info.value.details()
        r = httpx.post(f"{exposed.http_url}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "p0", "lora_path": path})
        assert r.status_code == 403 and "--adapter-root" in r.json()["error"]["message"]
        assert client.upload_adapter("p0", path).name == "p0"  # uploads: their own root
        assert client.generate("the cat", adapter="p0", max_new_tokens=2).adapter_version == 1


@pytest.mark.parametrize("choice", ["adapter_root", "allow_any"])
def test_an_exposed_server_loads_by_path_when_told_to(serve, make_engine, tiny_llama: Path,
                                                      tiny_adapters, choice: str) -> None:
    path = tiny_adapters("p1")
    extra = {"adapter_roots": [path.parent]} if choice == "adapter_root" else \
        {"allow_any_adapter_path": True}
    server = serve(lambda: make_engine(tiny_llama), **extra)
    server.server.state.exposed = True
    with server.client() as client:
        assert client.load_adapter("p1", path).name == "p1"


def test_loraplex_serve_on_every_interface_refuses_loads_by_path(tiny_llama: Path,
                                                                 tiny_adapters,
                                                                 tmp_path: Path) -> None:
    """A real `loraplex serve --host 0.0.0.0` without --adapter-root: it warns at start,
    refuses LoadAdapter and load_lora_adapter with 403, and still serves and uploads."""
    import subprocess

    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--model", str(tiny_llama),
           "--host", "0.0.0.0", "--port", "0", "--http-port", "0", "--device", "cpu",
           "--dtype", "float32", "--max-model-len", "128"]
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "OpenAI-compatible HTTP on" in log_path.read_text()
                   or proc.poll() is not None, timeout=90, what="listening")
        text = log_path.read_text()
        port = re.search(r"listening on 0\.0\.0\.0:(\d+)", text)[1]
        http_port = re.search(r"HTTP on http://0\.0\.0\.0:(\d+)", text)[1]
        assert "runtime loading by path (LoadAdapter, /v1/load_lora_adapter) is off" in text
        path = str(tiny_adapters("p2"))
        with Client(f"127.0.0.1:{port}") as client:
            client.wait_until_serving(timeout=90)
            with pytest.raises(grpc.RpcError) as info:
                client.load_adapter("p2", path)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            r = httpx.post(f"http://127.0.0.1:{http_port}/v1/load_lora_adapter", timeout=60,
                           json={"lora_name": "p2", "lora_path": path})
            assert r.status_code == 403, r.text
            assert client.upload_adapter("p2", path).name == "p2"
            assert client.generate("the cat", adapter="p2", max_new_tokens=2).usage
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
