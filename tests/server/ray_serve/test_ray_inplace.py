"""An in-place load (a training loop's new version) through Ray Serve reaches both replicas:
once LoadAdapter(replace) answers, every request on either replica runs on the new
version's weights and reports the same version number (the registry's for that load)."""

from __future__ import annotations

from typing import Any

import grpc
from loraplex.client import Client

from tests.server.ray_serve.conftest import PROMPTS, N
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
