"""Envoy's reports of retried attempts, over the gRPC access log service.

Envoy's router writes an upstream access log entry when the connection for a retry
is ready; envoy/bootstrap.yaml filters out first attempts, so nothing is sent for a
request that was not retried. Each entry names the request by the key the ext_proc
replica that routed it chose (`modeldock:rid`, copied by Envoy into the upstream
header `x-modeldock-rid`, since an upstream log entry carries no dynamic metadata)
and the endpoint the retry went to. Every ext_proc replica hears every entry and
acts on the requests it holds: the in-flight count moves to where the request now is.
The client's x-request-id is never the key: two live requests may share it.

The same service also hears Envoy's per-request usage log (`log_name` USAGE_LOG_NAME, an HCM access
log sent only for requests ext_proc marked `modeldock:usage`): one entry when the request ends, with
the backend's `usage` copied into dynamic metadata by json_to_metadata / sse_to_metadata
(`modeldock.usage`), read here into `UsageReport`s for the settlement (the app hands both kinds to the
registry, gateway/lifecycle.py: `Lifecycle.retried`, `Lifecycle.reported`): whether the
request reached a backend, and how it ended (the Envoy facts each field rests on: docs/envoy.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from envoy.service.accesslog.v3 import als_pb2

from modeldock.budgets.tokens import Usage
from modeldock.gateway.settlement import UsageReport
from modeldock.types import Endpoint
from modeldock.xds.resources import ROUTE_NAMESPACE

SERVICE = "envoy.service.accesslog.v3.AccessLogService"
# The upstream request header that carries modeldock:rid (envoy/bootstrap.yaml, modeldock/envoy.py).
RID_HEADER = "x-modeldock-rid"
# The HCM access log that reports each request needing usage (modeldock/envoy.py), and the metadata
# namespace Envoy's json_to_metadata / sse_to_metadata filters write the backend's usage into.
USAGE_LOG_NAME = "modeldock_usage"
USAGE_NAMESPACE = "modeldock.usage"
USAGE_KEYS = ("prompt_tokens", "completion_tokens")
# Every metadata key the usage filters write, with its path under the backend's `usage` object: the two
# counts, and the prompt tokens served from the prefix cache (flat `cached_tokens`, as Usage.from_mapping reads).
USAGE_PATHS: tuple[tuple[str, tuple[str, ...]], ...] = (
    *((key, (key,)) for key in USAGE_KEYS),
    ("cached_tokens", ("prompt_tokens_details", "cached_tokens")),
)

# Response flags (envoy.data.accesslog.v3.ResponseFlags) that name how a request ended. The retry limit
# (URX) is in neither: it comes with the failure or the backend's 503 that exhausted it.
TIMEOUT_FLAGS = ("upstream_request_timeout", "stream_idle_timeout", "duration_timeout",
                 "upstream_max_stream_duration_reached")
UPSTREAM_FAILURE_FLAGS = ("upstream_remote_reset", "upstream_connection_failure", "upstream_connection_termination",
                          "upstream_overflow", "no_healthy_upstream", "upstream_protocol_error", "no_cluster_found",
                          "dns_resolution_failure")
# response_code_details of a response that came from a backend as it was (not an Envoy reply).
VIA_UPSTREAM = "via_upstream"


def retried_attempts(message: als_pb2.StreamAccessLogsMessage) -> list[tuple[str, str]]:
    """(the gateway's request key, endpoint address as override_host writes it) for each entry."""
    found = []
    for entry in message.http_logs.log_entry:
        rid = entry.request.request_headers.get(RID_HEADER)
        socket = entry.common_properties.upstream_remote_address.socket_address
        if rid and socket.address and socket.port_value:
            found.append((rid, Endpoint(socket.address, socket.port_value).address))
    return found


def usage_reports(message: als_pb2.StreamAccessLogsMessage) -> list[UsageReport]:
    """One `UsageReport` per entry of Envoy's usage log that names a request (modeldock:rid)."""
    found = []
    for entry in message.http_logs.log_entry:
        common = entry.common_properties
        metadata = common.metadata.filter_metadata
        rid = ""
        if ROUTE_NAMESPACE in metadata:
            value = metadata[ROUTE_NAMESPACE].fields.get("rid")
            rid = value.string_value if value is not None else ""
        if not rid:
            rid = entry.request.request_headers.get(RID_HEADER, "")
        if not rid:
            continue
        usage = None
        if USAGE_NAMESPACE in metadata:
            fields = metadata[USAGE_NAMESPACE].fields
            usage = Usage.from_mapping({k: fields[k].number_value for k, _ in USAGE_PATHS
                                        if k in fields and fields[k].WhichOneof("kind") == "number_value"})
        socket = common.upstream_remote_address.socket_address
        endpoint = Endpoint(socket.address, socket.port_value).address if socket.address and socket.port_value else ""
        flags = common.response_flags
        timed_out = any(getattr(flags, name) for name in TIMEOUT_FLAGS)
        upstream_failed = any(getattr(flags, name) for name in UPSTREAM_FAILURE_FLAGS)
        cancelled = flags.downstream_connection_termination
        status = entry.response.response_code.value
        found.append(UsageReport(
            rid=rid, usage=usage, reached_backend=entry.response.upstream_header_bytes_received > 0,
            status=status, cancelled=cancelled, endpoint=endpoint, attempts=common.upstream_request_attempt_count,
            # Summed over every attempt (a retried request's earlier backends count), 0 when no connection
            # took a byte (refused everywhere, no healthy upstream, the client left while ext_proc held it).
            sent=common.upstream_wire_bytes_sent > 0,
            timed_out=timed_out, upstream_failed=upstream_failed,
            backend_error=(status >= 400 and entry.response.response_code_details == VIA_UPSTREAM
                           and not (timed_out or upstream_failed or cancelled)),
            response_bytes=entry.response.response_body_bytes,
        ))
    return found


class AttemptLogServicer:
    def __init__(self, on_retry: Callable[[str, str], None],
                 on_usage: Callable[[UsageReport], None] | None = None) -> None:
        self._on_retry = on_retry
        self._on_usage = on_usage
        self._closed = asyncio.Event()
        self.open_streams = 0

    async def StreamAccessLogs(  # noqa: N802 (gRPC name)
        self, _messages: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: grpc.aio.ServicerContext[Any, Any],
    ) -> als_pb2.StreamAccessLogsResponse:
        self.open_streams += 1
        closed = asyncio.ensure_future(self._closed.wait())
        usage_log: bool | None = None  # which log this stream carries: its first message names it
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
                if usage_log is None:
                    usage_log = message.identifier.log_name == USAGE_LOG_NAME
                if usage_log:
                    if self._on_usage is not None:
                        for report in usage_reports(message):
                            self._on_usage(report)
                    continue
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
