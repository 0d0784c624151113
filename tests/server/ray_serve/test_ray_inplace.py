"""An in-place load (a training loop's new version) through Ray Serve reaches both replicas:
once LoadAdapter(replace) answers, every request on either replica runs on the new
version's weights and reports the same version number (the registry's for that load), a preloaded adapter's first in-place load
included."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
from loraplex.client import Client

from tests.server.ray_serve.conftest import ADMIN, NAMES, PROMPTS, REPLICA, N
from tests.server.ray_serve.test_ray_serve import spread


def test_in_place_swap_reaches_both_replicas(client: Client, ray_app: Any, tiny_adapters,
                                             peft_reference) -> None:
    ids = PROMPTS[1]
    last = client.load_adapter("policy", tiny_adapters("ip-old")).version
    for made in ("ip-new", "ip-old"):
        info = client.load_adapter("policy", tiny_adapters(made), replace=True)
        assert info.version > last  # the registry's number for the load, every replica's
        version = last = info.version
        assert {a.name: a.version for a in client.list_adapters()}["policy"] == version
        results = spread(ray_app.target, "policy", ids, n=12)
        assert all(not isinstance(r, grpc.RpcError) for r, _ in results), results
        assert {tuple(r.token_ids) for r, _ in results} == {tuple(peft_reference(made, ids, N))}
        assert {r.adapter_version for r, _ in results} == {version}
        assert len({replica for _, replica in results}) == 2
    client.unload_adapter("policy")


def test_an_upload_reaches_both_replicas(client: Client, ray_app: Any, tiny_adapters,
                                         peft_reference) -> None:
    """UploadAdapter through Ray's proxy: written under --upload-dir, loaded everywhere."""
    ids = PROMPTS[2]
    info = client.upload_adapter("uploaded", tiny_adapters("ip-up"))
    assert info.version > 0
    assert str(ray_app.options.upload_dir) in info.path
    results = spread(ray_app.target, "uploaded", ids, n=12)
    assert all(not isinstance(r, grpc.RpcError) for r, _ in results), results
    assert {tuple(r.token_ids) for r, _ in results} == {tuple(peft_reference("ip-up", ids, N))}
    assert {r.adapter_version for r, _ in results} == {info.version}
    assert len({replica for _, replica in results}) == 2
    client.unload_adapter("uploaded")


def models_versions(url: str, headers: dict[str, str], name: str) -> set[tuple[str, int]]:
    """(replica, ``name``'s version) from /v1/models until both replicas answered. Calls
    without affinity go to the less busy replica, so calls one after another may all reach
    the same one (an idle replica answers at once); 8 calls in flight at a time keep one
    replica busy while the next call is routed: at most 16 rounds."""
    seen: set[tuple[str, int]] = set()

    def card(_: int) -> tuple[str, int]:
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=60)
        return r.headers[REPLICA], {m["id"]: m for m in r.json()["data"]}[name]["version"]

    with ThreadPoolExecutor(8) as pool:
        for _ in range(16):
            seen |= set(pool.map(card, range(8)))
            if len({replica for replica, _ in seen}) == 2:
                break
    return seen


def test_a_preloaded_adapters_first_in_place_load_is_a_new_version(
        client: Client, ray_app: Any, tiny_adapters, peft_reference) -> None:
    """Issue 42, item 11: a --lora-modules adapter is version 1 on every replica; its first
    in-place load (HTTP's load_inplace) must not report 1 again, in the load answer, the
    responses of both replicas and /v1/models of both; then a3's own weights come back."""
    name, ids = NAMES[3], PROMPTS[3]
    url, admin = ray_app.http_url, {"Authorization": f"Bearer {ADMIN}"}
    last = {a.name: a.version for a in client.list_adapters()}[name]
    assert last >= 1
    try:
        for made in ("ip-pre", name):  # a new adapter's weights, then a3's own again
            r = httpx.post(f"{url}/v1/load_lora_adapter", headers=admin, timeout=120, json={
                "lora_name": name, "lora_path": str(tiny_adapters(made)), "load_inplace": True})
            assert r.status_code == 200, r.text
            version = int(r.headers["loraplex-adapter-version"])
            assert version > last, (version, last)
            last = version
            results = spread(ray_app.target, name, ids, n=12)
            assert all(not isinstance(r, grpc.RpcError) for r, _ in results), results
            assert {tuple(r.token_ids) for r, _ in results} == {tuple(peft_reference(made, ids, N))}
            assert {r.adapter_version for r, _ in results} == {version}
            assert len({replica for _, replica in results}) == 2
            seen = models_versions(url, admin, name)
            assert {v for _, v in seen} == {version} and len(seen) == 2, seen
    finally:  # a3's own weights back even when an assertion failed: later modules use a3
        httpx.post(f"{url}/v1/load_lora_adapter", headers=admin, timeout=120, json={
            "lora_name": name, "lora_path": str(tiny_adapters(name)), "load_inplace": True})
