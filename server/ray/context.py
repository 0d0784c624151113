"""ProxyContext: what server/'s servicers need of a ``grpc.aio.ServicerContext``, on Ray
Serve's ``RayServegRPCContext``; and the token rule (server/auth.py) read from its metadata.

The servicers end a failed call with ``await context.abort(code, message)``
(server/grpc/status.py). Here ``abort`` sets the code and the message on Ray's context, which the
proxy sends to the client, and raises ``grpc.aio.AbortError`` as grpc.aio does; the
deployment catches it: a unary call returns an empty message (the code, details and
trailers reach the client); a stream raises again, as Ray's proxy reads a stream's status
only from its messages or from a raised error (code and details reach the client, trailers
do not).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from ..auth import bearer_token, refusal
from ..error_code import shorten
from ..grpc.auth_interceptor import scope_of_method
from ..server_options import ServerOptions

REPLICA_TRAILER = "loraplex-replica"


class ProxyContext:
    def __init__(self, ray_context: Any):
        self.ray_context = ray_context  # ray.serve.grpc_util.RayServegRPCContext

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self.ray_context.set_code(code)
        self.ray_context.set_details(details)
        raise grpc.aio.AbortError()

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return self.ray_context.invocation_metadata()

    def add_trailer(self, key: str, value: str) -> None:
        kept = [(k, v) for k, v in self.ray_context.trailing_metadata()
                if k not in (key, "request_id")]  # Ray adds request_id back itself
        self.ray_context.set_trailing_metadata([*kept, (key, value)])


async def authorize(context: ProxyContext, method: str, options: ServerOptions) -> None:
    """The single server's token rule for ``method`` (``/loraplex.v1.Service/Method``):
    UNAUTHENTICATED through ``abort`` when the bearer token is missing or wrong."""
    token = bearer_token(context.invocation_metadata())
    why = refusal(token, scope_of_method(method), options.api_token, options.admin_token,
                  method)
    if why is not None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, shorten(why))
