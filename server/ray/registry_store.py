"""GcsStore: the adapter registry's state in Ray's GCS key-value store (the store Serve's
controller checkpoints its own state in), so that the registry actor, restarted by Ray after
its process died, resumes the cluster's adapters instead of forgetting the hot-loaded ones.

The state lives as long as the cluster's GCS; ``launch.py`` clears it when it starts or
tears down the app, so a new ``serve --ray`` begins from its ``--lora-modules`` alone."""

from __future__ import annotations

import json
from typing import Any

from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_put

KV_NAMESPACE = "loraplex"


class GcsStore:
    """A RegistryStore (registry.py) under one key; picklable (it holds only the key), so it
    is given to the actor as a constructor argument, which Ray passes again on a restart."""

    def __init__(self, key: str):
        self.key = key

    def load(self) -> dict[str, Any] | None:
        raw = _internal_kv_get(self.key, namespace=KV_NAMESPACE)
        return json.loads(raw) if raw else None

    def save(self, state: dict[str, Any]) -> None:
        _internal_kv_put(self.key, json.dumps(state).encode(), overwrite=True,
                         namespace=KV_NAMESPACE)

    def clear(self) -> None:
        _internal_kv_del(self.key, namespace=KV_NAMESPACE)
