"""The HTTP front of a replica: server/http's OpenAI-compatible app (``build_app``) on the
replica's engine, behind Ray Serve's HTTP proxy on ``--http-port``.

What a replica adds to the single server's app:
- load and unload go to the whole cluster (``ClusterAdapters``: the AdapterAdmin RPCs' path);
- /metrics is every replica's exposition, each sample labelled ``replica="<id>"``
  (``merge_expositions``), so one scrape through the proxy sees the cluster;
- every response carries the header ``loraplex-replica`` (the replica id);
- a request with Ray's ``serve_multiplexed_model_id`` header naming a registered adapter is
  reported to Ray's multiplexing, as an Inference call with the metadata is, so Ray routes
  that adapter's next requests to this replica. The OpenAI body's ``model`` is not read by
  Ray's proxy: clients that want affinity send the header too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from ray import serve

from ..http.fastapi_app import build_app
from ..state import ServerState
from .admin import ClusterAdapters

REPLICA_HEADER = b"loraplex-replica"


def replica_app(state: ServerState, adapters: ClusterAdapters, replica_id: str,
                report_adapter: Callable[[str], Awaitable[None]],
                exposition: Callable[[], Awaitable[bytes]]) -> FastAPI:
    app = build_app(state, adapters=adapters, exposition=exposition)
    app.add_middleware(ReplicaMiddleware, replica_id=replica_id, report_adapter=report_adapter)
    return app


class ReplicaMiddleware:
    """Pure ASGI (streams and client disconnects pass through untouched): reports the
    multiplexed adapter, then adds the replica header to the response."""

    def __init__(self, app: Any, replica_id: str,
                 report_adapter: Callable[[str], Awaitable[None]]):
        self.app = app
        self.header = (REPLICA_HEADER, replica_id.encode())
        self.report_adapter = report_adapter

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        adapter = serve.get_multiplexed_model_id()
        if adapter:
            await self.report_adapter(adapter)

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


def merge_expositions(parts: list[tuple[str, bytes]]) -> bytes:
    """One Prometheus exposition from each replica's (replica id, text): every sample gets
    the label ``replica``; a family's samples from all replicas stay together."""
    families: dict[str, Metric] = {}
    for replica, text in parts:
        for family in text_string_to_metric_families(text.decode()):
            samples = [Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp,
                              s.exemplar) for s in family.samples]
            into = families.setdefault(family.name, family)
            if into is family:
                family.samples = samples
            else:
                into.samples.extend(samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    """A collector of already-made metric families (what generate_latest renders)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
