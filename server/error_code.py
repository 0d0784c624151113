"""ErrorCode: what kind of failure a call met, front-neutral (docs/contracts.md "Status
codes"). The layer below the fronts raises ``ServiceError(code, message)`` or the engine's
errors; ``code_of`` gives each its code, once, and each front maps the code: gRPC to
``grpc.StatusCode`` (server/grpc/status.py), HTTP to a status and OpenAI's error body
(server/http/error_bodies.py). This module imports neither front.
"""

from __future__ import annotations

import enum
import logging

from ..errors import (
    AdapterConfinementError,
    AdapterExistsError,
    AdapterFaultError,
    AdapterNotFoundError,
    CapacityError,
    EngineDeadError,
    InvalidRequestError,
)

log = logging.getLogger(__name__)


class ErrorCode(enum.Enum):
    """Named as gRPC names its status codes, which the contracts use."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # a bad field, prompt or adapter
    NOT_FOUND = "NOT_FOUND"  # an unknown adapter
    ALREADY_EXISTS = "ALREADY_EXISTS"  # a taken adapter name, without replace
    PERMISSION_DENIED = "PERMISSION_DENIED"  # an adapter path (or a file) outside its roots
    UNAUTHENTICATED = "UNAUTHENTICATED"  # no token, or a wrong one
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"  # the queue is full; an upload too large;
    # the grammar compiler is busy
    FAILED_PRECONDITION = "FAILED_PRECONDITION"  # the set-up refuses the call; an adapter's
    # data failed the request at run time (NaN / Inf logits, a refused re-read)
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"  # a client stream idle past the server's timeout
    UNAVAILABLE = "UNAVAILABLE"  # starting, draining: retry later or elsewhere
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"  # an engine fault; the engine loop has died


class ServiceError(Exception):
    """An error with its code chosen by the server (auth, queue, paths, phase)."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def code_of(exc: BaseException) -> tuple[ErrorCode, str]:
    """The code and message a caller sees for ``exc`` (an unexpected one is logged)."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, AdapterConfinementError):  # a ValueError: before the ValueError rule
        return ErrorCode.PERMISSION_DENIED, str(exc)
    if isinstance(exc, AdapterExistsError):  # a ValueError: before the ValueError rule
        return ErrorCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, AdapterNotFoundError):
        return ErrorCode.NOT_FOUND, _text(exc)
    if isinstance(exc, AdapterFaultError):
        return ErrorCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, EngineDeadError):
        return ErrorCode.INTERNAL, str(exc)
    if isinstance(exc, CapacityError):  # e.g. the grammar compiles pending are at the cap
        return ErrorCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, (InvalidRequestError, ValueError)):
        return ErrorCode.INVALID_ARGUMENT, str(exc)
    log.exception("internal error", exc_info=exc)
    return ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _text(exc: BaseException) -> str:
    # LookupError subclasses may be KeyErrors, whose str() adds quotes.
    return exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)


# Messages may quote what the caller sent (an adapter name, a path); on gRPC the status
# travels in a trailer, and one past a client's metadata limit (16 KiB by default) loses
# its status.
MAX_MESSAGE_CHARS = 2000


def shorten(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... [message cut: {len(message)} characters]"
