"""A gRPC access log service (envoy.service.accesslog.v3) that keeps every HTTP entry it hears, for tests.

    collector = AccessLogCollector()
    collector.add_to(grpc_aio_server)
    entry = await collector.wait_for(lambda e: e.request.request_id == rid)

    async with access_log_server() as (collector, port):  # a loopback server of its own, stopped on exit
        ...
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
from envoy.data.accesslog.v3 import accesslog_pb2
from envoy.service.accesslog.v3 import als_pb2

SERVICE = "envoy.service.accesslog.v3.AccessLogService"


@dataclass
class Heard:
    entry: accesslog_pb2.HTTPAccessLogEntry
    at: float  # time.monotonic() when it arrived
    message: int = 0  # the number of the message it came in (entries Envoy batched share one)


class AccessLogCollector:
    def __init__(self) -> None:
        self.heard: list[Heard] = []
        self.messages = 0
        self._changed = asyncio.Event()

    async def _stream(
        self, messages: AsyncIterator[als_pb2.StreamAccessLogsMessage], _ctx: grpc.aio.ServicerContext
    ) -> als_pb2.StreamAccessLogsResponse:
        async for message in messages:
            now = time.monotonic()
            self.messages += 1
            for entry in message.http_logs.log_entry:
                self.heard.append(Heard(entry, now, self.messages))
            self._changed.set()
        return als_pb2.StreamAccessLogsResponse()

    async def wait_for(
        self, match: Callable[[accesslog_pb2.HTTPAccessLogEntry], bool], timeout: float = 5.0
    ) -> Heard:
        async with asyncio.timeout(timeout):
            while True:
                for heard in self.heard:
                    if match(heard.entry):
                        return heard
                self._changed.clear()
                await self._changed.wait()

    def add_to(self, server: grpc.aio.Server) -> None:
        handler = grpc.stream_unary_rpc_method_handler(
            self._stream,
            request_deserializer=als_pb2.StreamAccessLogsMessage.FromString,
            response_serializer=als_pb2.StreamAccessLogsResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"StreamAccessLogs": handler}),))


@asynccontextmanager
async def access_log_server() -> AsyncIterator[tuple[AccessLogCollector, int]]:
    """A collector served on a loopback port of its own: (collector, port), for Envoy's access-log cluster."""
    collector = AccessLogCollector()
    server = grpc.aio.server()
    collector.add_to(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield collector, port
    finally:
        await server.stop(None)
