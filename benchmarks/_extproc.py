"""The three ext_proc messages Envoy sends for one completion request, for benchmarks."""

from __future__ import annotations

import json

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2


def envoy_messages(key: str, model: str) -> list[ep.ProcessingRequest]:
    """Request headers, the buffered body, and response headers naming the endpoint that served it."""
    def headers(*pairs: tuple[str, str]) -> ep.HttpHeaders:
        return ep.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]))

    req = ep.ProcessingRequest(request_headers=headers(
        (":method", "POST"), (":path", "/v1/chat/completions"), ("authorization", f"Bearer {key}"),
        ("content-type", "application/json"), ("x-request-id", "0f8fad5b-d9cb-469f-a165-70867728950e")))
    body = ep.ProcessingRequest(request_body=ep.HttpBody(body=json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}).encode(),
        end_of_stream=True))
    resp = ep.ProcessingRequest(response_headers=headers((":status", "200")))
    attrs = struct_pb2.Struct()
    attrs.update({"upstream.address": "127.0.0.1:1"})
    resp.attributes["envoy.filters.http.ext_proc"].CopyFrom(attrs)
    return [req, body, resp]
