"""Inference service: Generate and GenerateStream over the AsyncEngine, through the
front-neutral generate path (server/generation.py). The request's conversion (prompt rules,
chat template) runs on the engine's RequestProcessor thread, off the event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from ...proto import loraplex_pb2 as pb
from ...proto import loraplex_pb2_grpc as pb_grpc
from .. import generation
from ..generation import GenerateInput
from ..state import ServerState
from . import proto_convert, response_messages
from .status import streaming, unary


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, state: ServerState):
        self.state = state

    @unary
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> pb.GenerateResponse:
        inp = await self._input(request)
        finals = await generation.complete(self.state, inp)
        return response_messages.generate_response(finals, request.adapter)

    @streaming
    async def GenerateStream(self, request: pb.GenerateRequest,
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        inp = await self._input(request)
        usage, first = response_messages.Usage(), True
        with self.state.admit() as engine:
            async with aclosing(generation.outputs(self.state, engine, inp)) as outputs:
                async for out in outputs:
                    yield response_messages.stream_response(out, request.adapter, usage, first)
                    first = False

    async def _input(self, request: pb.GenerateRequest) -> GenerateInput:
        engine = self.state.require_engine()
        return await engine.processor.run(proto_convert.generate_input, request,
                                          engine.engine.tokenizer)
