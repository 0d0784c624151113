"""ServerInfo service: what is served with which capacity knobs, and how busy it is."""

from __future__ import annotations

import grpc

from ...engine.llm_engine import LLMEngine
from ...proto import loraplex_pb2 as pb
from ...proto import loraplex_pb2_grpc as pb_grpc
from ..description import describe
from ..state import ServerState
from .status import unary


def _engine_stats(engine: LLMEngine) -> dict[str, int]:
    return {**engine.stats(), "num_adapters": len(engine.list_adapters())}


class ServerInfoServicer(pb_grpc.ServerInfoServicer):
    def __init__(self, state: ServerState):
        self.state = state

    @unary
    async def GetServerInfo(self, request: pb.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> pb.GetServerInfoResponse:
        engine = self.state.require_engine(while_draining=True)
        info = describe(engine.engine, self.state.options)
        return pb.GetServerInfoResponse(**info, status=self.state.phase.value)

    @unary
    async def GetStats(self, request: pb.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> pb.GetStatsResponse:
        engine = self.state.require_engine(while_draining=True)
        stats = await engine.run(_engine_stats)
        known = set(pb.GetStatsResponse.DESCRIPTOR.fields_by_name)
        return pb.GetStatsResponse(**{k: v for k, v in stats.items() if k in known},
                                   num_in_flight=self.state.in_flight,
                                   requests_total=self.state.requests_total)
