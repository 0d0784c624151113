"""One gRPC status per error: the gRPC front's map of the front-neutral ``ErrorCode``
(server/error_code.py, docs/contracts.md "Status codes"), in one place.

Servicer methods raise; the ``unary`` / ``streaming`` decorators turn what they raise into
``context.abort(code, message)``. Messages say what was wrong and what is allowed.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import grpc

from ..error_code import ErrorCode, code_of, shorten

T = TypeVar("T")

# every ErrorCode is named as its gRPC status code
GRPC_CODE: dict[ErrorCode, grpc.StatusCode] = {
    code: getattr(grpc.StatusCode, code.name) for code in ErrorCode}


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and message a caller sees for ``exc``."""
    code, message = code_of(exc)
    return GRPC_CODE[code], message


async def abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, message = status_of(exc)
    await context.abort(code, shorten(message))


Unary = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[T]]
Streaming = Callable[[Any, Any, grpc.aio.ServicerContext], AsyncIterator[T]]


def unary(fn: Unary) -> Unary:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            await abort(context, exc)

    return wrapper


def streaming(fn: Streaming) -> Streaming:
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[Any]:
        try:
            # aclosing: when the call ends early, the inner generator's cleanup runs now
            async with aclosing(fn(self, request, context)) as items:
                async for item in items:
                    yield item
        except (asyncio.CancelledError, grpc.aio.AbortError, GeneratorExit):
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            await abort(context, exc)

    return wrapper
