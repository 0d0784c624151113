"""AdapterAdmin service: hot load (from a path or uploaded: adapter_upload.py), unload
and list adapters (server/adapter_ops.py), and reset the prefix cache. Load and unload go
through ``adapters`` (AdapterOps): this engine's by default, the cluster's on a Ray replica
(server/ray/admin.py), as HTTP's load and unload routes do."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from ...proto import loraplex_pb2 as pb
from ...proto import loraplex_pb2_grpc as pb_grpc
from .. import adapter_ops
from ..adapter_ops import AdapterOps, LocalAdapters
from ..state import ServerState
from . import proto_convert
from .adapter_upload import receive_upload
from .status import unary
from .upload_limits import UploadLimits


class AdapterAdminServicer(pb_grpc.AdapterAdminServicer):
    def __init__(self, state: ServerState, adapters: AdapterOps | None = None):
        self.state = state
        self.adapters = adapters or LocalAdapters(state)
        self.uploads = UploadLimits.from_options(state.options)  # this server's streams

    @unary
    async def LoadAdapter(self, request: pb.LoadAdapterRequest,
                          context: grpc.aio.ServicerContext) -> pb.AdapterInfo:
        info = await self.adapters.load(request.name, request.path, replace=request.replace,
                                        pin=request.pin)
        return proto_convert.adapter_info(info)

    @unary
    async def UploadAdapter(self, requests: AsyncIterator[pb.UploadAdapterRequest],
                            context: grpc.aio.ServicerContext) -> pb.AdapterInfo:
        return proto_convert.adapter_info(await receive_upload(self.state, self.adapters,
                                                         self.uploads, requests))

    @unary
    async def ResetPrefixCache(self, request: pb.ResetPrefixCacheRequest,
                               context: grpc.aio.ServicerContext) -> pb.ResetPrefixCacheResponse:
        await adapter_ops.reset_prefix_cache(self.state)
        return pb.ResetPrefixCacheResponse()

    @unary
    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest,
                            context: grpc.aio.ServicerContext) -> pb.UnloadAdapterResponse:
        await self.adapters.unload(request.name)
        return pb.UnloadAdapterResponse(name=request.name)

    @unary
    async def ListAdapters(self, request: pb.ListAdaptersRequest,
                           context: grpc.aio.ServicerContext) -> pb.ListAdaptersResponse:
        infos = await adapter_ops.list_adapters(self.state)
        return pb.ListAdaptersResponse(adapters=[proto_convert.adapter_info(i) for i in infos])
