"""Inference service: Generate and GenerateStream over the AsyncEngine, through the
front-neutral generate path (server/generation.py). The request's translation (prompt rules,
chat template) and the engine's checks run together on the engine's InputProcessor thread,
off the event loop (``generation.check``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from ...engine.input_processor import EngineRequest
from ...proto import loraplex_pb2 as pb
from ...proto import loraplex_pb2_grpc as pb_grpc
from .. import generation
from ..state import ServerState
from . import proto_convert, response_messages
from .status import streaming, unary


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, state: ServerState):
        self.state = state

    @unary
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> pb.GenerateResponse:
        checked = await self._check(request)
        finals = await generation.complete(self.state, checked)
        return response_messages.generate_response(finals, request.adapter)

    @streaming
    async def GenerateStream(self, request: pb.GenerateRequest,
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        checked = await self._check(request)
        usage, first = response_messages.Usage(), True
        with self.state.admit() as engine:
            async with aclosing(generation.outputs(self.state, engine, checked)) as outputs:
                async for out in outputs:
                    yield response_messages.stream_response(out, request.adapter, usage, first)
                    first = False

    async def _check(self, request: pb.GenerateRequest) -> EngineRequest:
        await generation.resolve(self.state, request.adapter)  # its tokenizer known first
        tokenizer = self.state.tokenizer_of(request.adapter)  # an adapter's own, if any
        checked, _ = await generation.check(
            self.state, lambda: (proto_convert.generate_input(request, tokenizer), None))
        return checked
