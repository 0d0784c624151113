"""Adapters for training loops over a real server (gRPC and HTTP on 127.0.0.1): in-place
loads and their versions on every surface, uploads over the stream (equal to the same
adapter from disk, whatever the chunks; each bad upload its code, nothing half
registered), adapters resolved by name on first use, and the prefix cache's reset."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from loraplex.client import AsyncClient, adapter_files
from loraplex.proto import loraplex_pb2 as pb

ADMIN = "adm"
IDS = [10, 20, 30, 40, 50]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
LIMIT = 1 << 20  # --max-upload-bytes


@pytest.fixture(scope="module")
def resolver_dir(tmp_path_factory, tiny_adapters) -> Path:
    root = tmp_path_factory.mktemp("resolver") / "dir"
    root.mkdir()
    for name in ("r0", "r1", "r2"):
        shutil.copytree(tiny_adapters(name), root / name)
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{not json")
    shutil.copytree(tiny_adapters("outside"), root.parent / "outside")  # must stay unreachable
    (root / "link").symlink_to(root.parent / "outside")
    return root


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path, tiny_adapters, resolver_dir: Path) -> Any:
    return serve(lambda: make_engine(tiny_llama), http_port=0, admin_token=ADMIN,
                 adapter_roots=[tiny_adapters("a0").parent], lora_resolver_dir=resolver_dir,
                 max_upload_bytes=LIMIT)


@pytest.fixture(scope="module")
def client(server: Any):
    with server.client(admin_token=ADMIN) as c:
        yield c


AUTH = {"Authorization": f"Bearer {ADMIN}"}  # the only token: every route needs it (issue 42)


def admin_post(server: Any, route: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.http_url}{route}", json=body, timeout=60, headers=AUTH)


def gen(client: Any, adapter: str) -> Any:
    return client.generate(prompt_token_ids=IDS, adapter=adapter, **GREEDY)


# ---- in-place versions -------------------------------------------------------------------
def test_in_place_loads_and_versions_on_every_surface(server, client, tiny_adapters) -> None:
    v1, v2 = str(tiny_adapters("a0")), str(tiny_adapters("a1"))
    r = admin_post(server, "/v1/load_lora_adapter", {"lora_name": "p", "lora_path": v1})
    assert r.status_code == 200 and r.headers["loraplex-adapter-version"] == "1"
    first = gen(client, "p")
    assert first.adapter_version == 1
    r = admin_post(server, "/v1/load_lora_adapter", {"lora_name": "p", "lora_path": v2})
    assert r.status_code == 400 and "load_inplace" in r.json()["error"]["message"]
    with pytest.raises(grpc.RpcError) as info:
        client.load_adapter("p", v2)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    r = admin_post(server, "/v1/load_lora_adapter",
                   {"lora_name": "p", "lora_path": v2, "load_inplace": True})
    assert r.status_code == 200 and r.headers["loraplex-adapter-version"] == "2"
    assert client.load_adapter("p", v1, replace=True).version == 3
    stream = list(client.generate_stream(prompt_token_ids=IDS, adapter="p", **GREEDY))
    assert {m.adapter_version for m in stream} == {3}
    assert [t for m in stream for t in m.token_ids] == list(first.token_ids)  # v3 is v1's
    assert {a.name: a.version for a in client.list_adapters()}["p"] == 3
    body = {"model": "p", "prompt": IDS, "max_tokens": 3, "temperature": 0.0}
    for stream_it in (False, True):
        r = httpx.post(f"{server.http_url}/v1/completions", json={**body, "stream": stream_it},
                       timeout=60, headers=AUTH)
        assert r.status_code == 200 and r.headers["loraplex-adapter-version"] == "3"
    r = httpx.post(f"{server.http_url}/v1/completions", json={**body, "model": ""}, timeout=60,
                   headers=AUTH)
    assert "loraplex-adapter-version" not in r.headers  # the base model has no version
    cards = {c["id"]: c for c in httpx.get(f"{server.http_url}/v1/models",
                                           headers=AUTH).json()["data"]}
    assert cards["p"]["version"] == 3
    metrics = httpx.get(f"{server.http_url}/metrics").text
    assert _gauge(metrics, "p") == 3.0
    assert gen(client, "p").adapter_version == 3 and not gen(client, "").HasField(
        "adapter_version")


def test_a_preloaded_adapters_first_in_place_load_is_version_2(serve, make_engine, tiny_llama,
                                                                tiny_adapters) -> None:
    """Issue 42, item 11, on one server: an adapter given at launch (lora_modules) is
    version 1; its first in-place load is 2 on every surface, never 1 again."""
    one = serve(lambda: make_engine(tiny_llama, lora_modules={"pre": str(tiny_adapters("a2"))}),
                http_port=0, admin_token=ADMIN, adapter_roots=[tiny_adapters("a0").parent])
    with one.client(admin_token=ADMIN) as c:
        assert {a.name: a.version for a in c.list_adapters()}["pre"] == 1
        r = admin_post(one, "/v1/load_lora_adapter", {
            "lora_name": "pre", "lora_path": str(tiny_adapters("a3")), "load_inplace": True})
        assert r.status_code == 200 and r.headers["loraplex-adapter-version"] == "2"
        assert gen(c, "pre").adapter_version == 2
        auth = {"Authorization": f"Bearer {ADMIN}"}  # every route needs a token once one is set
        r = httpx.post(f"{one.http_url}/v1/completions", timeout=60, headers=auth, json={
            "model": "pre", "prompt": IDS, "max_tokens": 2, "temperature": 0.0})
        assert r.status_code == 200 and r.headers["loraplex-adapter-version"] == "2"
        cards = {m["id"]: m for m in httpx.get(f"{one.http_url}/v1/models",
                                               headers=auth).json()["data"]}
        assert cards["pre"]["version"] == 2
        assert c.load_adapter("pre", tiny_adapters("a2"), replace=True).version == 3


def _gauge(metrics: str, adapter: str) -> float | None:
    for line in metrics.splitlines():
        if line.startswith("loraplex:adapter_version{") and f'adapter="{adapter}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_reset_prefix_cache_on_both_fronts(server, client) -> None:
    ids = list(range(60, 100))
    client.generate(prompt_token_ids=ids, **GREEDY)
    assert client.generate(prompt_token_ids=ids, **GREEDY).usage.cached_prompt_tokens > 0
    client.reset_prefix_cache()
    assert client.generate(prompt_token_ids=ids, **GREEDY).usage.cached_prompt_tokens == 0
    assert httpx.post(f"{server.http_url}/reset_prefix_cache").status_code == 401
    assert admin_post(server, "/reset_prefix_cache").status_code == 200
    assert client.generate(prompt_token_ids=ids, **GREEDY).usage.cached_prompt_tokens == 0
    with server.client() as anonymous, pytest.raises(grpc.RpcError) as info:
        anonymous.reset_prefix_cache()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


# ---- uploads -----------------------------------------------------------------------------
def upload(client: Any, name: str, config: bytes, weights: bytes, cuts: list[int],
           replace: bool = False, declared: int | None = None) -> pb.AdapterInfo:
    header = pb.UploadAdapterHeader(name=name, adapter_config=config.decode(), replace=replace,
                                    size_bytes=len(weights) if declared is None else declared)
    edges = [0, *cuts, len(weights)]
    messages = [pb.UploadAdapterRequest(header=header)] + [
        pb.UploadAdapterRequest(chunk=weights[a:b]) for a, b in itertools.pairwise(edges)]
    return client._s.admin.UploadAdapter(iter(messages), **client._s.adm(60))


def leftovers(server: Any) -> list[Path]:
    return sorted(server.engine.uploads.root.iterdir())


def test_an_upload_equals_the_same_adapter_from_disk(server, client, tiny_adapters) -> None:
    client.load_adapter("disk", tiny_adapters("u0"))
    want = gen(client, "disk").token_ids
    info = client.upload_adapter("up", tiny_adapters("u0"))
    disk = {a.name: a for a in client.list_adapters()}["disk"]
    assert (info.version, info.rank, info.size_bytes) == (1, disk.rank, disk.size_bytes)
    assert gen(client, "up").token_ids == want
    config, weights = adapter_files(tiny_adapters("u0"))
    n = len(weights)
    for i, cuts in enumerate([[1], [8, 9, 10], [n // 3, n // 2], list(range(1, n, 4099)),
                              [n - 1]]):
        assert upload(client, "up", config, weights, cuts, replace=True).version == i + 2
        assert gen(client, "up").token_ids == want
    client.unload_adapter("up")
    assert leftovers(server) == []


def test_the_command_line_uploads(server, client, tiny_adapters, capsys) -> None:
    from loraplex.cli import main

    argv = ["adapters", "upload", "cli-up", str(tiny_adapters("u4")), "--server",
            server.target, "--admin-token", ADMIN]
    assert main(argv) == 0 and capsys.readouterr().out.startswith("cli-up\t")
    assert main([*argv, "--replace"]) == 0
    assert {a.name: a.version for a in client.list_adapters()}["cli-up"] == 2
    assert main(argv) == 1 and "ALREADY_EXISTS" in capsys.readouterr().err


def test_a_peft_model_uploads_from_memory(server, client, tiny_llama, tiny_adapters) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32),
        tiny_adapters("u1"))
    client.upload_adapter("mem", model)
    client.load_adapter("mem-disk", tiny_adapters("u1"))
    assert gen(client, "mem").token_ids == gen(client, "mem-disk").token_ids


def test_bad_uploads_each_get_their_code_and_leave_nothing(server, client, tiny_llama,
                                                           tiny_adapters, tmp_path) -> None:
    from tests.conftest import make_tiny_model

    config, weights = adapter_files(tiny_adapters("u2"))
    client.upload_adapter("keep", tiny_adapters("u2"))
    want = gen(client, "keep").token_ids
    wide = make_tiny_model(tmp_path / "wide", hidden_size=128)
    other_base = config.decode().replace('"base_model_name_or_path": ',
                                         f'"base_model_name_or_path": "{wide}", "x": ')
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        ({"weights": b"garbage" * 10}, invalid, "safetensors"),
        ({"weights": weights[:-5], "declared": len(weights) - 5}, invalid, ""),
        ({"config": b"{not json"}, invalid, "JSON"),
        ({"weights": b"\0" * (LIMIT + 1)}, grpc.StatusCode.RESOURCE_EXHAUSTED,
         "--max-upload-bytes"),
        ({"declared": len(weights) + 10}, invalid, "ended after"),
        ({"declared": LIMIT + 1}, grpc.StatusCode.RESOURCE_EXHAUSTED, "header.size_bytes"),
    ]
    for replace in (True, False):
        for changes, code, fragment in cases:
            args = {"config": config, "weights": weights, **changes}
            declared = args.pop("declared", None)
            with pytest.raises(grpc.RpcError) as info:
                upload(client, "keep" if replace else "new", args["config"], args["weights"],
                       [7], replace=replace, declared=declared)
            assert info.value.code() == code and fragment in info.value.details(), changes
    with pytest.raises(grpc.RpcError) as info:
        upload(client, "keep", config, weights, [])
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    # an upload's base_model_name_or_path outside its own directory is never opened (issue
    # 42; it used to be compared, and refused here): the adapter loads, its shapes checked
    assert upload(client, "wide-base", other_base.encode(), weights, [7]).name == "wide-base"
    client.unload_adapter("wide-base")
    adapters = {a.name: a for a in client.list_adapters()}
    assert "new" not in adapters and adapters["keep"].version == 1
    assert gen(client, "keep").token_ids == want
    names = [p.name.rsplit("-", 1)[0] for p in leftovers(server)]
    assert names.count("keep") == 1 and "new" not in names  # keep's own upload only


def test_a_stream_cut_midway_registers_nothing(server, client, tiny_adapters) -> None:
    config, weights = adapter_files(tiny_adapters("u3"))
    before = leftovers(server)
    hold = threading.Event()

    def messages():
        header = pb.UploadAdapterHeader(name="cut", adapter_config=config.decode())
        yield pb.UploadAdapterRequest(header=header)
        yield pb.UploadAdapterRequest(chunk=weights[:100])
        hold.wait(30)

    call = client._s.admin.UploadAdapter.future(messages(), **client._s.adm(60))
    _wait(lambda: len(leftovers(server)) > len(before))  # the server is writing
    call.cancel()
    hold.set()
    _wait(lambda: leftovers(server) == before)
    assert "cut" not in {a.name for a in client.list_adapters()}


def _wait(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ---- the resolver ------------------------------------------------------------------------
def test_resolver_first_use_and_concurrent_first_uses(server, tiny_adapters) -> None:
    resolver = server.server.state.resolver
    reads = resolver.reads

    async def many() -> list[Any]:
        async with AsyncClient(server.target, admin_token=ADMIN) as c:
            return await asyncio.gather(*[
                c.generate(prompt_token_ids=IDS, adapter="r1", **GREEDY) for _ in range(4)])

    outs = asyncio.run(many())
    assert resolver.reads == reads + 1  # four first uses, one read
    assert {tuple(o.token_ids) for o in outs} == {tuple(outs[0].token_ids)}
    with server.client(admin_token=ADMIN) as c:
        c.load_adapter("r1-disk", tiny_adapters("r1"))
        assert list(outs[0].token_ids) == list(gen(c, "r1-disk").token_ids)
        assert gen(c, "r1").adapter_version == 1  # registered once, then served as loaded
    body = {"model": "r2", "prompt": IDS, "max_tokens": 2}
    assert httpx.post(f"{server.http_url}/v1/completions", json=body, timeout=60,
                      headers=AUTH).status_code == 200
    assert resolver.reads == reads + 2


@pytest.mark.parametrize("name, code, http, fragment", [
    ("nowhere", grpc.StatusCode.NOT_FOUND, 404, "holds no directory"),
    # not canonical (issue 42): a bad name, before the resolver looks
    ("r0/../../outside", grpc.StatusCode.INVALID_ARGUMENT, 400, "'..' segment"),
    ("link", grpc.StatusCode.NOT_FOUND, 404, "leads outside"),
    ("broken", grpc.StatusCode.INVALID_ARGUMENT, 400, "JSON"),
])
def test_resolver_refusals(server, client, name, code, http, fragment) -> None:
    with pytest.raises(grpc.RpcError) as info:
        gen(client, name)
    assert info.value.code() == code and fragment in info.value.details()
    r = httpx.post(f"{server.http_url}/v1/completions", timeout=60, headers=AUTH,
                   json={"model": name, "prompt": IDS, "max_tokens": 2})
    assert r.status_code == http and fragment in r.json()["error"]["message"]
    assert name not in {a.name for a in client.list_adapters()}


def test_resolver_from_a_local_hugging_face_cache(serve, make_engine, tiny_llama,
                                                  tiny_adapters, tmp_path) -> None:
    """The Hub resolver reads a cache the test builds (Hub layout: refs/main names the
    snapshot), offline: a cached repo loads on first use, an uncached one is NOT_FOUND."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny-lora"
    shutil.copytree(tiny_adapters("hf"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    hub = serve(lambda: make_engine(tiny_llama), lora_resolver_hf_cache=tmp_path / "hub",
                adapter_roots=[tiny_adapters("hf").parent])
    with hub.client() as c:
        out = gen(c, "org/tiny-lora")
        c.load_adapter("hf-disk", tiny_adapters("hf"))
        assert out.token_ids == gen(c, "hf-disk").token_ids and out.adapter_version == 1
        with pytest.raises(grpc.RpcError) as info:
            gen(c, "org/not-cached")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "Hugging Face cache" in info.value.details()
