"""grpc.health.v1 on the gRPC front: ServerState's phase as SERVING / NOT_SERVING, for the
server as a whole ("") and each loraplex service. Invariant: health says SERVING exactly
while the phase is SERVING (it follows ``ServerState.set_phase``)."""

from __future__ import annotations

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from ..state import Phase

SERVICE_NAMES = ("loraplex.v1.Inference", "loraplex.v1.AdapterAdmin", "loraplex.v1.ServerInfo")


class PhaseHealth:
    """gRPC's health servicer, told each phase (a ``ServerState.phase_observers`` entry)."""

    def __init__(self) -> None:
        self.servicer = HealthServicer()

    async def follow(self, phase: Phase) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if phase is Phase.SERVING else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", *SERVICE_NAMES):
            await self.servicer.set(service, status)
