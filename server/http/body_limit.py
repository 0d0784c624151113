"""BodyLimit: the HTTP front refuses a request body over ``--max-request-bytes`` with 413,
before the body is parsed (uvicorn and FastAPI read a body of any size by default; gRPC
refuses a message over the same limit, server/loraplex_server.py).

A declared ``Content-Length`` over the limit is answered at once, without reading the body;
a chunked body is counted as it arrives and refused at the chunk that passes the limit, so
at most the limit plus one chunk is ever held.
"""

from __future__ import annotations

from http import HTTPStatus

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .error_bodies import error_response


def _too_large(limit: int, size: str) -> str:
    return (f"the request body is {size}; the server takes at most {limit} bytes "
            "(--max-request-bytes)")


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server's HTTP parser refuses it
    return None


class BodyLimit:
    """Pure ASGI middleware around the FastAPI app (streaming responses pass untouched)."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.limit:
            response = error_response(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                      _too_large(self.limit, f"{declared} bytes"))
            await response(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # FastAPI passes an HTTPException raised while it reads the body on to
                    # the app's handler (error_bodies.py), which answers 413 in OpenAI's shape
                    raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                        _too_large(self.limit, f"over {self.limit} bytes"))
            return message

        await self.app(scope, counted, send)
