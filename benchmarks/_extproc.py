"""The ext_proc messages Envoy sends for one completion request, for benchmarks (built by tests/support)."""

from __future__ import annotations

import json

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from tests.support.extproc_messages import ATTR, body_request, headers_request, raw_headers, struct, with_attributes


def envoy_messages(key: str, model: str) -> list[ep.ProcessingRequest]:
    """What Envoy sends modeldock: the buffered body with the request attributes, and nothing else."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}).encode()
    return [body_request(body, request_id="0f8fad5b-d9cb-469f-a165-70867728950e", authorization=f"Bearer {key}")]


def response_headers_message() -> ep.ProcessingRequest:
    """The response headers an earlier design also had Envoy send (with the serving endpoint)."""
    msg = headers_request(raw_headers((":status", "200")), end_of_stream=False, field="response_headers")
    return with_attributes(msg, {ATTR: struct({
        "upstream.address": "127.0.0.1:1", "request.method": "POST", "request.path": "/v1/chat/completions"})})
