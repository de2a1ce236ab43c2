"""Envoy's reports of retried attempts, over the gRPC access log service.

Envoy's router writes an upstream access log entry when the connection for a retry
is ready; envoy/bootstrap.yaml filters out first attempts, so nothing is sent for a
request that was not retried. Each entry names the request by the key the ext_proc
replica that routed it chose (`modeldock:rid`, copied by Envoy into the upstream
header `x-modeldock-rid`, since an upstream log entry carries no dynamic metadata)
and the endpoint the retry went to. Every ext_proc replica hears every entry and
acts on the requests it holds: the in-flight count moves to where the request now is.
The client's x-request-id is never the key: two live requests may share it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.service.accesslog.v3 import als_pb2

from modeldock.types import Endpoint

SERVICE = "envoy.service.accesslog.v3.AccessLogService"
# The upstream request header that carries modeldock:rid (envoy/bootstrap.yaml, modeldock/envoy.py).
RID_HEADER = "x-modeldock-rid"


def retried_attempts(message: als_pb2.StreamAccessLogsMessage) -> list[tuple[str, str]]:
    """(the gateway's request key, endpoint address as override_host writes it) for each entry."""
    found = []
    for entry in message.http_logs.log_entry:
        rid = entry.request.request_headers.get(RID_HEADER)
        socket = entry.common_properties.upstream_remote_address.socket_address
        if rid and socket.address and socket.port_value:
            found.append((rid, Endpoint(socket.address, socket.port_value).address))
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
