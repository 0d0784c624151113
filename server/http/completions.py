"""POST /v1/completions and /v1/chat/completions: one request each, through the
front-neutral generate path (server/generation.py), whole or streamed as vLLM streams. The
body's translation (tokenizing, the chat template) and the engine's checks run together on
the engine's InputProcessor thread, off the event loop (``generation.check``)."""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from ...engine.input_processor import EngineRequest, RequestInput
from ...engine.output_processor import RequestOutput
from .. import generation
from ..auth import Scope
from ..generation import OpenStream
from ..state import ServerState
from .error_bodies import error_body, http_status_of
from .models import VERSION_HEADER
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from .request_convert import chat_input, completion_input
from .responses import DONE, Reply, View, sse
from .route_auth import require, server_state
from .streaming import ClosingStreamingResponse, until_disconnect

router = APIRouter(dependencies=[Depends(require(Scope.API))])

Converter = Callable[[Any, Any, str], tuple[RequestInput, View]]


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await _serve(request, body, completion_input, f"cmpl-{uuid.uuid4().hex}")


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    parser = server_state(request).options.auto_tool_parser
    return await _serve(request, body, functools.partial(chat_input, auto_tool_parser=parser),
                        f"chatcmpl-{uuid.uuid4().hex}")


async def _serve(request: Request, body: SamplingFields, convert: Converter, rid: str
                 ) -> Response:
    state = server_state(request)
    await generation.resolve(state, body.model)  # loaded first: its tokenizer is known
    tokenizer = state.tokenizer_of(body.model)  # the adapter's own, if it brings one
    checked, view = await generation.check(state, lambda: convert(body, tokenizer, rid))
    reply = Reply(rid, body.model or state.model_name, view, tokenizer)
    return await _answer(state, request, reply, checked, body)


async def _answer(state: ServerState, request: Request, reply: Reply, checked: EngineRequest,
                  body: SamplingFields) -> Response:
    if not body.stream:
        finals = await until_disconnect(request, generation.complete(state, checked))
        return JSONResponse(reply.body(finals), headers=_version_header(finals[0]))
    # Admitted and accepted by the engine before the 200 goes out: a bad request is a 4xx.
    stream = await OpenStream.open(state, checked)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return ClosingStreamingResponse(_events(stream, reply, include_usage), stream.aclose,
                                    headers=_version_header(stream.first))


def _version_header(out: RequestOutput) -> dict[str, str]:
    """The adapter version the request runs on (none for the base model)."""
    return {} if out.adapter_version is None else {VERSION_HEADER: str(out.adapter_version)}


async def _events(stream: OpenStream, reply: Reply, include_usage: bool
                  ) -> AsyncIterator[bytes]:
    """vLLM's SSE: (chat) a role chunk per choice, a chunk per new text (and per new token
    with logprobs) of any choice, each choice's last with its finish reason, then the usage
    chunk if asked for, then ``[DONE]``. An engine fault mid-stream is an error event (the
    status line is long gone), then ``[DONE]``."""
    try:
        if reply.chat:
            for chunk in reply.role_chunks(stream.choices):
                yield sse(chunk)
        async for out in stream:
            chunk = reply.chunk(out)
            if chunk is not None:
                yield sse(chunk)
    except Exception as exc:  # noqa: BLE001 - reported in the stream
        status, message = http_status_of(exc)
        yield sse(error_body(status, message))
    else:
        if include_usage:
            yield sse(reply.usage_chunk())
    yield DONE
