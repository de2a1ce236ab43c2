"""The standard gRPC health service (grpc.health.v1) for modeldock's gRPC servers.

Kubernetes gRPC probes and Envoy's active health checks both speak it. The overall
status (service "") is NOT_SERVING until the server can do its job, and again
from the moment it starts to drain.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    def __init__(self, *services: str) -> None:
        self._servicer = health.aio.HealthServicer()
        self._services = ("", *services)
        self.serving = False

    def add_to(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    async def set_serving(self, serving: bool) -> None:
        self.serving = serving
        for service in self._services:
            await self._servicer.set(service, SERVING if serving else NOT_SERVING)

    async def shutdown(self) -> None:
        """NOT_SERVING for good: watchers are told, and later changes are ignored."""
        self.serving = False
        await self._servicer.enter_graceful_shutdown()
