"""The adapter registry actor dies (its process killed, as on a node fault): Ray restarts it,
it resumes from Ray's GCS store, and the cluster keeps serving every adapter, hot-loaded
ones included; loads and unloads after the restart reach every replica again."""

from __future__ import annotations

import time
from typing import Any

import grpc
import ray
from loraplex.client import Client
from loraplex.server.ray.launch import NAMESPACE, registry_name

from tests.server.ray_serve.conftest import NAMES, PROMPTS, N
from tests.server.ray_serve.test_ray_serve import spread


def snapshot_after_restart(registry: Any, timeout: float = 60) -> Any:
    """The registry's snapshot once it answers again (a call that reached the old process
    fails with ActorUnavailableError: Ray cannot say whether it ran; this one is a read)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get(registry.snapshot.remote(), timeout=timeout)
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline, "the registry did not come back"
            time.sleep(0.2)


def test_registry_restart_keeps_every_adapter(client: Client, ray_app: Any, tiny_adapters,
                                              peft_reference) -> None:
    client.load_adapter("kept", tiny_adapters("kept"))
    registry = ray.get_actor(registry_name(ray_app.ray_options.app_name), namespace=NAMESPACE)
    before = ray.get(registry.snapshot.remote())
    ray.kill(registry, no_restart=False)  # its process dies; Ray restarts it
    start = time.monotonic()
    after = snapshot_after_restart(registry)
    print(f"\n[ray] registry actor restarted and answering in {time.monotonic() - start:.1f}s")
    assert after.version == before.version and set(after.entries) == set(before.entries)
    assert {"kept", *NAMES} <= {i.name for i in client.list_adapters()}
    assert client.health() == "SERVING"

    ids = PROMPTS[2]
    for name in ("kept", NAMES[0]):
        results = spread(ray_app.target, name, ids, n=12)
        assert all(not isinstance(r, grpc.RpcError) for r, _ in results), results
        assert {tuple(r.token_ids) for r, _ in results} == {tuple(peft_reference(name, ids, N))}
        assert len({replica for _, replica in results}) == 2

    # changes after the restart wait for both replicas again
    client.load_adapter("later", tiny_adapters("later"))
    results = spread(ray_app.target, "later", ids, n=12)
    assert all(not isinstance(r, grpc.RpcError) for r, _ in results), results
    assert {tuple(r.token_ids) for r, _ in results} == {tuple(peft_reference("later", ids, N))}
    for name in ("later", "kept"):
        client.unload_adapter(name)
    results = spread(ray_app.target, "kept", ids, n=12)
    assert all(isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.NOT_FOUND
               for r, _ in results), results
