"""The gRPC front's bearer-token check: the server interceptor, and the scope of each RPC
(server/auth.py holds the rule; Ray's proxy context applies it too)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from ..auth import Scope, bearer_token, refusal

ADMIN_PREFIX = "/loraplex.v1.AdapterAdmin/"
# health and reflection (both versions) stay open; every other service is API by default,
# so a service added later is guarded without a change here
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


def scope_of_method(method: str) -> Scope:
    if method.startswith(ADMIN_PREFIX):
        return Scope.ADMIN
    return Scope.OPEN if method.startswith(OPEN_PREFIXES) else Scope.API


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
