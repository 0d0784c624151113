"""POST /v1/completions and /v1/chat/completions: one request each, through the
front-neutral generate path (server/generation.py), whole or streamed as vLLM streams."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from ...engine.output_processor import RequestOutput
from .. import generation
from ..auth import Scope
from ..generation import GenerateInput, OpenStream
from ..state import ServerState
from .auth import require, server_state
from .convert import chat_input, completion_input
from .errors import error_body, http_status_of
from .models import VERSION_HEADER
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from .responses import DONE, Reply, sse
from .streaming import ClosingStreamingResponse, until_disconnect

router = APIRouter(dependencies=[Depends(require(Scope.API))])


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = server_state(request)
    reply = Reply(f"cmpl-{uuid.uuid4().hex}", body.model or state.model_name, chat=False)
    inp = completion_input(body, _tokenizer(state), reply.id)
    return await _answer(state, request, reply, inp, body)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    reply = Reply(f"chatcmpl-{uuid.uuid4().hex}", body.model or state.model_name, chat=True)
    inp = chat_input(body, _tokenizer(state), reply.id)
    return await _answer(state, request, reply, inp, body)


def _tokenizer(state: ServerState) -> object | None:
    return state.require_engine().engine.tokenizer


async def _answer(state: ServerState, request: Request, reply: Reply, inp: GenerateInput,
                  body: SamplingFields) -> Response:
    if not body.stream:
        out = await until_disconnect(request, generation.complete(state, inp))
        return JSONResponse(reply.body(out), headers=_version_header(out))
    # Admitted and accepted by the engine before the 200 goes out: a bad request is a 4xx.
    stream = await OpenStream.open(state, inp)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return ClosingStreamingResponse(_events(stream, reply, include_usage), stream.aclose,
                                    headers=_version_header(stream.first))


def _version_header(out: RequestOutput) -> dict[str, str]:
    """The adapter version the request runs on (none for the base model)."""
    return {} if out.adapter_version is None else {VERSION_HEADER: str(out.adapter_version)}


async def _events(stream: OpenStream, reply: Reply, include_usage: bool
                  ) -> AsyncIterator[bytes]:
    """vLLM's SSE: (chat) a role chunk, a chunk per new text and one with the finish
    reason, then the usage chunk if asked for, then ``[DONE]``. An engine fault mid-stream
    is an error event (the status line is long gone), then ``[DONE]``."""
    last: RequestOutput | None = None
    try:
        if reply.chat:
            yield sse(reply.role_chunk())
        async for out in stream:
            last = out
            if out.new_text or out.finished:
                yield sse(reply.chunk(out))
    except Exception as exc:  # noqa: BLE001 - reported in the stream
        status, message = http_status_of(exc)
        yield sse(error_body(status, message))
    else:
        if include_usage and last is not None:
            yield sse(reply.usage_chunk(last))
    yield DONE
