"""Inference service: Generate and GenerateStream over the AsyncEngine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from ..engine.async_engine import AsyncEngine
from ..engine.output_processor import RequestOutput
from ..proto import loraplex_pb2 as pb
from ..proto import loraplex_pb2_grpc as pb_grpc
from . import convert
from .state import ServerState
from .status import ServiceError, streaming, unary


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, state: ServerState):
        self.state = state

    @unary
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> pb.GenerateResponse:
        with self.state.admit() as engine:
            last: RequestOutput | None = None
            async with aclosing(self._outputs(engine, request)) as outputs:
                async for out in outputs:
                    last = out
        assert last is not None and last.finished  # the engine always ends with a finished one
        return convert.generate_response(last, request.adapter)

    @streaming
    async def GenerateStream(self, request: pb.GenerateRequest,
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        with self.state.admit() as engine:
            async with aclosing(self._outputs(engine, request)) as outputs:
                async for out in outputs:
                    yield convert.stream_response(out, request.adapter)

    async def _outputs(self, engine: AsyncEngine, request: pb.GenerateRequest
                       ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for ``request``. Closing this early (client cancel, deadline)
        aborts the request in the engine at once, which frees its KV blocks."""
        params = convert.sampling_params(request.params)
        prompt = convert.prompt_of(request, engine.engine.tokenizer)
        adapter = convert.adapter_of(request.adapter, self.state.options.served_model_name)
        rid = convert.request_id_of(request)
        async with aclosing(engine.generate(prompt, params, adapter, rid)) as outputs:
            async for out in outputs:
                if out.finish_reason == "error":
                    raise ServiceError(grpc.StatusCode.INTERNAL,
                                       f"request {out.request_id} failed in the engine: "
                                       f"{out.error or 'no detail'}")
                yield out
