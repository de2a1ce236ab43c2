"""The ext_proc messages Envoy sends for one completion request, for benchmarks."""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2


def _attributes(msg: ep.ProcessingRequest, values: dict[str, str]) -> ep.ProcessingRequest:
    struct = struct_pb2.Struct()
    struct.update(values)
    msg.attributes["envoy.filters.http.ext_proc"].CopyFrom(struct)
    return msg


def envoy_messages(key: str, model: str) -> list[ep.ProcessingRequest]:
    """What Envoy sends modeldock: the buffered body with the request attributes, and nothing else."""
    return [_attributes(ep.ProcessingRequest(request_body=ep.HttpBody(body=json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}).encode(),
        end_of_stream=True)), {
        "request.method": "POST", "request.path": "/v1/chat/completions",
        "request.id": "0f8fad5b-d9cb-469f-a165-70867728950e", "request.headers['authorization']": f"Bearer {key}"})]


def response_headers_message() -> ep.ProcessingRequest:
    """The response headers an earlier design also had Envoy send (with the serving endpoint)."""
    return _attributes(ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")]))), {
        "upstream.address": "127.0.0.1:1", "request.method": "POST", "request.path": "/v1/chat/completions"})
