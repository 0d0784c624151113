"""AdapterAdmin service: hot load, unload and list adapters, on the engine thread."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from ..engine.llm_engine import LLMEngine
from ..proto import loraplex_pb2 as pb
from ..proto import loraplex_pb2_grpc as pb_grpc
from . import convert
from .adapter_paths import check_adapter_name, confine
from .state import ServerState
from .status import ServiceError, unary


def _lora_method(engine: LLMEngine, name: str) -> Callable[..., Any]:
    method = getattr(engine, name, None)
    if method is None:
        raise ServiceError(grpc.StatusCode.UNIMPLEMENTED,
                           f"this engine has no multi-LoRA support ({name} is missing)")
    return method


class AdapterAdminServicer(pb_grpc.AdapterAdminServicer):
    def __init__(self, state: ServerState):
        self.state = state

    @unary
    async def LoadAdapter(self, request: pb.LoadAdapterRequest,
                          context: grpc.aio.ServicerContext) -> pb.AdapterInfo:
        engine = self.state.require_engine()
        options = self.state.options
        name = check_adapter_name(request.name, options.served_model_name)
        path = confine(request.path, options.adapter_roots)
        model = engine.engine
        _lora_method(model, "add_adapter")
        # Reading and validating the weights is slow (disk): it happens here, off the engine
        # thread, so running requests keep stepping; registering is quick, between steps.
        read = getattr(model, "read_adapter", None)
        weights = await asyncio.to_thread(read, str(path), name) if read is not None else None
        extra = {"weights": weights} if weights is not None else {}
        info = await engine.run(lambda e: e.add_adapter(
            name, str(path), replace=request.replace, pin=request.pin, **extra))
        return convert.adapter_info(info)

    @unary
    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest,
                            context: grpc.aio.ServicerContext) -> pb.UnloadAdapterResponse:
        engine = self.state.require_engine()
        if not request.name:
            raise ValueError("adapter name is empty: give the name of a loaded adapter "
                             "(the base model cannot be unloaded)")
        await engine.run(lambda e: _lora_method(e, "remove_adapter")(request.name))
        return pb.UnloadAdapterResponse(name=request.name)

    @unary
    async def ListAdapters(self, request: pb.ListAdaptersRequest,
                           context: grpc.aio.ServicerContext) -> pb.ListAdaptersResponse:
        engine = self.state.require_engine()
        infos = await engine.run(lambda e: _lora_method(e, "list_adapters")())
        return pb.ListAdaptersResponse(adapters=[convert.adapter_info(i) for i in infos])
