"""Envoy's reports of retried attempts, over the gRPC access log service.

Envoy's router writes an upstream access log entry when the connection for a retry
is ready; envoy/bootstrap.yaml filters out first attempts, so nothing is sent for a
request that was not retried. Each entry names the request (its x-request-id) and
the endpoint the retry went to. Every ext_proc replica hears every entry and acts
on the requests it holds: the in-flight count moves to where the request now is.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.service.accesslog.v3 import als_pb2

from modeldock.types import Endpoint

SERVICE = "envoy.service.accesslog.v3.AccessLogService"


def retried_attempts(message: als_pb2.StreamAccessLogsMessage) -> list[tuple[str, str]]:
    """(request id, endpoint address as override_host writes it) for each entry."""
    found = []
    for entry in message.http_logs.log_entry:
        socket = entry.common_properties.upstream_remote_address.socket_address
        if entry.request.request_id and socket.address and socket.port_value:
            found.append((entry.request.request_id, Endpoint(socket.address, socket.port_value).address))
    return found


class AttemptLogServicer:
    def __init__(self, on_retry: Callable[[str, str], None]) -> None:
        self._on_retry = on_retry
        self._closed = asyncio.Event()
        self.open_streams = 0

    async def StreamAccessLogs(  # noqa: N802 (gRPC name)
        self, _messages: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: grpc.aio.ServicerContext,
    ) -> als_pb2.StreamAccessLogsResponse:
        self.open_streams += 1
        closed = asyncio.ensure_future(self._closed.wait())
        try:
            while True:
                read = asyncio.ensure_future(context.read())
                await asyncio.wait((read, closed), return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    read.cancel()
                    break
                message = read.result()
                if message is grpc.aio.EOF:
                    break
                for request_id, address in retried_attempts(message):
                    self._on_retry(request_id, address)
        finally:
            closed.cancel()
            self.open_streams -= 1
        return als_pb2.StreamAccessLogsResponse()

    def close(self) -> None:
        """End every open log stream: Envoy keeps them open for good, which would hold up a graceful stop."""
        self._closed.set()

    def add_to(self, server: grpc.aio.Server) -> None:
        handler = grpc.stream_unary_rpc_method_handler(
            self.StreamAccessLogs, request_deserializer=als_pb2.StreamAccessLogsMessage.FromString,
            response_serializer=als_pb2.StreamAccessLogsResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"StreamAccessLogs": handler}),))
