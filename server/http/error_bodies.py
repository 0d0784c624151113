"""Errors as OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``, with the HTTP
status of each ``ErrorCode`` (docs/contracts.md "Status codes", mapped once here): every
route raises what the gRPC servicers raise, and ``server/error_code.py``'s ``code_of``
picks the code."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..error_code import ErrorCode, ServiceError, code_of, shorten
from .streaming import ClientGone

HTTP_STATUS: dict[ErrorCode, HTTPStatus] = {  # any other code: 500
    ErrorCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    ErrorCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    # google.rpc.Code's mapping: the client must change something (here: the adapter)
    ErrorCode.FAILED_PRECONDITION: HTTPStatus.BAD_REQUEST,
    ErrorCode.ALREADY_EXISTS: HTTPStatus.BAD_REQUEST,  # as vLLM does
    ErrorCode.RESOURCE_EXHAUSTED: HTTPStatus.TOO_MANY_REQUESTS,
    ErrorCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.DEADLINE_EXCEEDED: HTTPStatus.REQUEST_TIMEOUT,
    ErrorCode.UNAUTHENTICATED: HTTPStatus.UNAUTHORIZED,
    ErrorCode.PERMISSION_DENIED: HTTPStatus.FORBIDDEN,
    ErrorCode.UNIMPLEMENTED: HTTPStatus.NOT_IMPLEMENTED,
    ErrorCode.INTERNAL: HTTPStatus.INTERNAL_SERVER_ERROR,
}
# OpenAI's error types, as its SDK and vLLM name them
ERROR_TYPE: dict[HTTPStatus, str] = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.FORBIDDEN: "PermissionDeniedError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "BadRequestError",  # the SDK has no class of its own
    HTTPStatus.TOO_MANY_REQUESTS: "RateLimitError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client gave up on
RETRY_AFTER_S = 1  # RESOURCE_EXHAUSTED: the queue drains in about a request's time


def error_body(status: HTTPStatus, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": shorten(message),
                      "type": ERROR_TYPE.get(status, "InternalServerError"),
                      "param": param, "code": int(status)}}


def error_response(status: HTTPStatus, message: str, param: str | None = None
                   ) -> JSONResponse:
    headers = {}
    if status is HTTPStatus.TOO_MANY_REQUESTS:
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if status is HTTPStatus.UNAUTHORIZED:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_body(status, message, param), status_code=int(status),
                        headers=headers)


def http_status_of(exc: BaseException) -> tuple[HTTPStatus, str]:
    """The HTTP status and message for ``exc``: its ErrorCode, mapped."""
    code, message = code_of(exc)
    return HTTP_STATUS.get(code, HTTPStatus.INTERNAL_SERVER_ERROR), message


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors: each names its field and what is wanted."""
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":  # loc holds a character offset, no field
            parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', '')})")
            continue
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "the request body"
        param = param or (where if loc else None)
        parts.append(f"{where}: {err.get('msg')}")
    return "; ".join(parts[:5]) or "invalid request", param


def install(app: FastAPI) -> None:
    """Every error leaves as OpenAI's body; validation errors are 400, not FastAPI's 422."""

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(HTTPStatus.BAD_REQUEST, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(HTTPStatus(exc.status_code), str(exc.detail))

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        status, message = http_status_of(exc)
        return error_response(status, message)

    @app.exception_handler(ClientGone)
    async def on_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it

    # Domain errors by class (handled where raised); Exception last (logged, 500).
    for cls in (ServiceError, ValueError, LookupError, RuntimeError, Exception):
        app.add_exception_handler(cls, on_error)
