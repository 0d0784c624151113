"""Bearer-token auth: the rule both fronts share (``required_tokens``, ``refusal``) and the
gRPC server interceptor (server/http/auth.py reads the same rule from HTTP headers).

AdapterAdmin needs the admin token when one is set; Inference and ServerInfo need the API
token when one is set (the admin token is accepted there too). Health and reflection stay
open so that load balancers and grpcurl can probe without secrets.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Awaitable, Callable, Sequence

import grpc

ADMIN_PREFIX = "/loraplex.v1.AdapterAdmin/"
API_PREFIXES = ("/loraplex.v1.Inference/", "/loraplex.v1.ServerInfo/")


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` header, if there is one."""
    for key, value in metadata or ():
        if key.lower() == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _matches(token: str | None, accepted: Sequence[str]) -> bool:
    # compare_digest on every candidate: the time taken does not reveal which one is close
    hits = [hmac.compare_digest(token.encode(), a.encode()) for a in accepted] if token else []
    return any(hits)


class Scope(enum.Enum):
    ADMIN = "admin"  # adapter load / unload
    API = "api"  # inference and server info
    OPEN = "open"  # health, reflection, version, metrics


def required_tokens(scope: Scope, api_token: str | None, admin_token: str | None
                    ) -> tuple[str, list[str]] | None:
    """(the flag that sets the token, the tokens accepted) for ``scope``; None if open.
    The one rule of both fronts: admin calls need --admin-token when it is set; API calls
    need --api-token when it is set, and take the admin token too."""
    if scope is Scope.ADMIN and admin_token is not None:
        return "--admin-token", [admin_token]
    if scope is Scope.API and api_token is not None:
        return "--api-token", [t for t in (api_token, admin_token) if t]
    return None


def refusal(token: str | None, scope: Scope, api_token: str | None, admin_token: str | None,
            what: str) -> str | None:
    """Why ``token`` may not call ``what`` (UNAUTHENTICATED), or None if it may."""
    required = required_tokens(scope, api_token, admin_token)
    if required is None:
        return None
    flag, accepted = required
    if _matches(token, accepted):
        return None
    why = "no bearer token was sent" if token is None else "the bearer token is wrong"
    return f"{what} needs authorization: Bearer <token> with the server's {flag}; {why}"


def scope_of_method(method: str) -> Scope:
    if method.startswith(ADMIN_PREFIX):
        return Scope.ADMIN
    return Scope.API if method.startswith(API_PREFIXES) else Scope.OPEN


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_token: str | None, admin_token: str | None):
        self.api_token = api_token
        self.admin_token = admin_token

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        token = bearer_token(details.invocation_metadata)
        why = refusal(token, scope_of_method(details.method), self.api_token,
                      self.admin_token, details.method)
        return handler if why is None else _refusal(handler, why)


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that fails with UNAUTHENTICATED."""

    async def deny(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request: object, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)
