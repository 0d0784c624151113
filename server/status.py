"""One gRPC status per error: the mapping of docs/contracts.md ("Status codes"), in one place.

Servicer methods raise; the ``unary`` / ``streaming`` decorators turn what they raise into
``context.abort(code, message)``. Messages say what was wrong and what is allowed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import grpc

from ..engine.errors import (
    AdapterExistsError,
    AdapterNotFoundError,
    EngineDeadError,
    InvalidRequestError,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


class ServiceError(Exception):
    """An error with its status code chosen by the server (auth, queue, paths, phase)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a caller sees for ``exc``."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, AdapterExistsError):  # a ValueError: before the ValueError rule
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, AdapterNotFoundError):
        return grpc.StatusCode.NOT_FOUND, _text(exc)
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.INTERNAL, str(exc)
    if isinstance(exc, (InvalidRequestError, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    log.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _text(exc: BaseException) -> str:
    # LookupError subclasses may be KeyErrors, whose str() adds quotes.
    return exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)


# Messages may quote what the caller sent (an adapter name, a path); the status travels in
# a trailer, and one past a client's metadata limit (16 KiB by default) loses its status.
MAX_MESSAGE_CHARS = 2000


def shorten(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... [message cut: {len(message)} characters]"


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
