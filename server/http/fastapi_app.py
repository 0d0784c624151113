"""build_app: the FastAPI application of the HTTP front, around the server's ServerState
(the same engine, admission, phase and metrics as the gRPC front). One server passes nothing
more; a Ray replica passes its cluster-wide adapter operations and /metrics of every
replica (server/ray/http_front.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI

from ..adapter_ops import AdapterOps, LocalAdapters
from ..description import version
from ..state import ServerState
from . import completions, error_bodies, models, probes, tokens
from .body_limit import BodyLimit
from .route_auth import check_scopes


def build_app(state: ServerState, adapters: AdapterOps | None = None,
              exposition: Callable[[], Awaitable[bytes]] | None = None) -> FastAPI:
    """``adapters``: what /v1/load_lora_adapter and /v1/unload_lora_adapter call (``load``,
    ``unload``; default: this engine's); ``exposition``: the /metrics body (default: this
    server's metrics)."""
    app = FastAPI(title="loraplex", version=version(), docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server_state = state
    app.state.adapters = adapters or LocalAdapters(state)
    app.state.exposition = exposition or (lambda: probes.local_exposition(state))
    error_bodies.install(app)
    app.add_middleware(BodyLimit, limit=state.options.max_request_bytes)
    for module in (completions, models, tokens, probes):
        app.include_router(module.router)
    check_scopes(app)  # every route declares who may call it
    return app
