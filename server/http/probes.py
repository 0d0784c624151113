"""GET /health, /ping and /metrics: open routes (no token), as vLLM has them, so that load
balancers, Kubernetes probes and Prometheus need no secret; GET /version, which needs the
API token when one is set (server/auth.py's rule: it is not a probe)."""

from __future__ import annotations

from http import HTTPStatus

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from ...errors import EngineDeadError
from ..auth import Scope
from ..description import version
from ..engine_snapshot import take_snapshot
from ..state import Phase, ServerState
from .error_bodies import error_response
from .route_auth import require, server_state

router = APIRouter()
OPEN = [Depends(require(Scope.OPEN))]


@router.get("/health", dependencies=OPEN)
@router.get("/ping", dependencies=OPEN)
@router.post("/ping", dependencies=OPEN)
async def health(request: Request) -> Response:
    """200 (empty) while SERVING; 503 with the reason while starting, draining or dead."""
    state = server_state(request)
    if state.phase is Phase.SERVING:
        return Response(status_code=HTTPStatus.OK)
    try:
        state.require_engine()
    except Exception as exc:  # noqa: BLE001 - the reason becomes the body
        return error_response(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
    return error_response(HTTPStatus.SERVICE_UNAVAILABLE, state.phase.value)


@router.get("/version", dependencies=[Depends(require(Scope.API))])
async def get_version() -> dict[str, str]:
    return {"version": version()}


@router.get("/metrics", dependencies=OPEN)
async def metrics(request: Request) -> Response:
    """Prometheus text (``app.state.exposition``: this server's, or every replica's)."""
    return Response(await request.app.state.exposition(), media_type=CONTENT_TYPE_LATEST)


async def local_exposition(state: ServerState) -> bytes:
    """This server's metrics. The gauges are refreshed from a snapshot the engine thread
    takes between steps; without a live engine the last values stay."""
    engine = state.engine
    if engine is not None and engine.alive:
        try:
            state.metrics.refresh(await engine.run(take_snapshot))
        except EngineDeadError:
            pass
    return state.metrics.exposition()
