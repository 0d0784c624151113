"""Bearer tokens on the HTTP routes: the rule of server/auth.py (``required_tokens``), read
from the ``Authorization: Bearer`` header. A refusal is a 401 with OpenAI's error body."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request

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

    return check
