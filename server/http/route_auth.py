"""Bearer tokens on the HTTP routes: the rule of server/auth.py (``required_tokens``), read
from the ``Authorization: Bearer`` header. A refusal is a 401 with OpenAI's error body.

Invariant: every route declares its scope with a ``require(scope)`` dependency (the open
ones ``Scope.OPEN``); ``check_scopes`` refuses to build an app with a route that does not,
so a route added later cannot be open by omission."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator

from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute

from ..auth import Scope, bearer_token, refusal
from ..error_code import ErrorCode, ServiceError
from ..state import ServerState


def server_state(request: Request) -> ServerState:
    return request.app.state.server_state


def require(scope: Scope) -> Callable[[Request], Awaitable[None]]:
    """A route dependency that refuses callers without the token ``scope`` needs."""

    async def check(request: Request) -> None:
        options = server_state(request).options
        header = request.headers.get("authorization")
        token = bearer_token([("authorization", header)] if header is not None else [])
        why = refusal(token, scope, options.api_token, options.admin_token,
                      f"{request.method} {request.url.path}")
        if why is not None:
            raise ServiceError(ErrorCode.UNAUTHENTICATED, why)

    check.scope = scope  # type: ignore[attr-defined]  # read by route_scope
    return check


def route_scope(route: APIRoute) -> Scope | None:
    """The scope ``route`` declares (its router's ``require`` or its own); None if none."""
    scopes = [getattr(d.dependency, "scope", None) for d in route.dependencies]
    found = [s for s in scopes if isinstance(s, Scope)]
    return found[0] if len(found) == 1 else None


def api_routes(routes: Iterable[BaseRoute]) -> Iterator[BaseRoute]:
    """Every route of ``routes``, included routers walked (FastAPI keeps them whole)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from api_routes(inner.routes)
        else:
            yield route


def check_scopes(app: FastAPI) -> None:
    """RuntimeError naming a route of ``app`` that declares no scope (or several), or is not
    an API route (which could not declare one)."""
    for route in api_routes(app.routes):
        if not isinstance(route, APIRoute) or route_scope(route) is None:
            raise RuntimeError(f"HTTP route {getattr(route, 'path', route)!r} declares no auth "
                               "scope: give it one require(Scope...) dependency")
