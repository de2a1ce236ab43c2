"""ext_proc messages as Envoy sends them, and gateways to send them to: written once for every test.

Used by the unit tests of the flow (tests/unit/extproc), the gRPC contract tests and the benchmarks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from redis.asyncio import Redis

from modeldock.admission.limits import Admission
from modeldock.clock import Clock, FakeClock
from modeldock.config import parse_config
from modeldock.gateway import Gateway
from modeldock.picking import Picker
from modeldock.types import Endpoint

ATTR = "envoy.filters.http.ext_proc"  # the namespace Envoy puts request_attributes under
AUTH = "request.headers['authorization']"


def struct(values: Mapping[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(values)
    return s


def with_attributes(msg: ep.ProcessingRequest, attributes: Mapping[str, struct_pb2.Struct]) -> ep.ProcessingRequest:
    """`msg` with these attribute namespaces (namespace -> Struct) set."""
    for name, value in attributes.items():
        msg.attributes[name].CopyFrom(value)
    return msg


def body_request(body: bytes, *, method: str | None = "POST", path: str | None = "/v1/chat/completions",
                 request_id: str | None = "r-1", authorization: str | None = None,
                 extra: Mapping[str, Any] | None = None, end_of_stream: bool = True) -> ep.ProcessingRequest:
    """The buffered request body with the request attributes Envoy sends beside it; None leaves one out
    (no such header). `extra`: more attributes, of any JSON type."""
    values: dict[str, Any] = {name: value for name, value in
                              [("request.method", method), ("request.path", path), ("request.id", request_id),
                               (AUTH, authorization)] if value is not None}
    values.update(extra or {})
    msg = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=end_of_stream))
    return with_attributes(msg, {ATTR: struct(values)})


def raw_headers(*pairs: tuple[str, str]) -> list[base_pb2.HeaderValue]:
    return [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]


def headers_request(headers: Sequence[base_pb2.HeaderValue], *, end_of_stream: bool = True,
                    field: str = "request_headers") -> ep.ProcessingRequest:
    """A headers message (`field`: request_headers or response_headers)."""
    return ep.ProcessingRequest(**{field: ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers),
                                                         end_of_stream=end_of_stream)})


def retry_report(*attempts: tuple[str, str]) -> als_pb2.StreamAccessLogsMessage:
    """What Envoy's upstream access log sends when a retry's connection is ready: (rid, ip:port). The rid
    (ext_proc's key, modeldock:rid) rides in the logged x-modeldock-rid header; the client's x-request-id
    is sent as well, set here to the same text to show that it is not what ext_proc reads."""
    msg = als_pb2.StreamAccessLogsMessage(identifier=als_pb2.StreamAccessLogsMessage.Identifier(
        node=base_pb2.Node(id="envoy"), log_name="modeldock_attempts"))
    for rid, address in attempts:
        host, _, port = address.rpartition(":")
        entry = msg.http_logs.log_entry.add()
        entry.request.request_id = "client-" + rid
        entry.request.request_headers["x-modeldock-rid"] = rid
        entry.common_properties.upstream_remote_address.socket_address.address = host
        entry.common_properties.upstream_remote_address.socket_address.port_value = int(port)
    return msg


def make_gateway(config: Mapping[str, Any], endpoints: Mapping[str, Sequence[str]], *, clock: Clock | None = None,
                 picker: Callable[[Clock], Picker] | None = None, seed: int | None = None,
                 redis_client_factory: Callable[[str, float], Redis] | None = None) -> Gateway:
    """A Gateway on `config` (a config file's dict) with these endpoints (model -> ["ip:port", ...]) announced.
    `seed`: a seeded picker tie-break, so a run replays; `picker`: build the picker yourself."""
    parsed = parse_config(dict(config))
    clock = clock or FakeClock()
    if picker is not None:
        chosen = picker(clock)
    else:
        chosen = Picker(clock, rng=random.Random(seed) if seed is not None else None)
    admission = (Admission(parsed, clock, redis_client_factory=redis_client_factory)
                 if redis_client_factory is not None else Admission(parsed, clock))
    gw = Gateway(parsed, clock, chosen, admission)
    for model, addresses in endpoints.items():
        gw.on_endpoints(model, tuple(Endpoint.parse(a) for a in addresses))
    return gw


def usage_log_entry(msg: als_pb2.StreamAccessLogsMessage, *, rid: str | None, usage: Mapping[str, Any] | None = None,
                    status: int = 200, upstream_header_bytes: int = 120, endpoint: str = "",
                    attempts: int = 1, cancelled: bool = False) -> None:
    """Append what Envoy's per-request usage log (HCM, log_name modeldock_usage) sends for one request:
    all dynamic metadata (modeldock:rid, modeldock.usage from the json/sse filters) and the response."""
    entry = msg.http_logs.log_entry.add()
    entry.request.request_id = "client-id"
    metadata = entry.common_properties.metadata.filter_metadata
    if rid is not None:
        metadata["modeldock"].CopyFrom(struct({"rid": rid, "usage": "1", "cluster": "model:m"}))
    if usage is not None:
        metadata["modeldock.usage"].CopyFrom(struct(usage))
    entry.response.response_code.value = status
    entry.response.upstream_header_bytes_received = upstream_header_bytes
    entry.common_properties.upstream_request_attempt_count = attempts
    entry.common_properties.response_flags.downstream_connection_termination = cancelled
    if endpoint:
        host, _, port = endpoint.rpartition(":")
        entry.common_properties.upstream_remote_address.socket_address.address = host
        entry.common_properties.upstream_remote_address.socket_address.port_value = int(port)


def usage_log_message() -> als_pb2.StreamAccessLogsMessage:
    return als_pb2.StreamAccessLogsMessage(identifier=als_pb2.StreamAccessLogsMessage.Identifier(
        node=base_pb2.Node(id="envoy"), log_name="modeldock_usage"))
