"""build_app: the FastAPI application of the HTTP front, around the server's ServerState
(the same engine, admission, phase and metrics as the gRPC front)."""

from __future__ import annotations

from fastapi import FastAPI

from ..server_info import version
from ..state import ServerState
from . import completions, errors, models, probes, tokens


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="loraplex", version=version(), docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server_state = state
    errors.install(app)
    for module in (completions, models, tokens, probes):
        app.include_router(module.router)
    return app
