"""Inference service: Generate and GenerateStream over the AsyncEngine, through the
front-neutral generate path (server/generation.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from ..proto import loraplex_pb2 as pb
from ..proto import loraplex_pb2_grpc as pb_grpc
from . import convert, generation
from .state import ServerState
from .status import streaming, unary


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, state: ServerState):
        self.state = state

    @unary
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> pb.GenerateResponse:
        inp = convert.generate_input(request, self._tokenizer())
        last = await generation.complete(self.state, inp)
        return convert.generate_response(last, request.adapter)

    @streaming
    async def GenerateStream(self, request: pb.GenerateRequest,
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        inp = convert.generate_input(request, self._tokenizer())
        with self.state.admit() as engine:
            async with aclosing(generation.outputs(self.state, engine, inp)) as outputs:
                async for out in outputs:
                    yield convert.stream_response(out, request.adapter)

    def _tokenizer(self) -> object | None:
        return self.state.require_engine().engine.tokenizer
