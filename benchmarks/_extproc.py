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


def picker_messages(key: str, model: str, chunks: int = 16) -> list[tuple[ep.ProcessingRequest, int]]:
    """What a gateway's Envoy sends its endpoint picker for one streamed completion (FULL_DUPLEX_STREAMED,
    docs/mesh.md), each with the number of answers it gets: the request headers (held), the body (the
    held headers answer and the body), the response headers, `chunks` SSE chunks (each echoed)."""
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm

    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}).encode()
    start = headers_request(raw_headers((":method", "POST"), (":path", "/v1/chat/completions"),
                                        ("x-request-id", "0f8fad5b-d9cb-469f-a165-70867728950e"),
                                        ("authorization", f"Bearer {key}"), ("content-type", "application/json"),
                                        ("content-length", str(len(body)))), end_of_stream=False)
    start.protocol_config.request_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
    start.protocol_config.response_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
    out = [(start, 0), (ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)), 2),
           (headers_request(raw_headers((":status", "200")), end_of_stream=False, field="response_headers"), 1)]
    sse = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'
    for i in range(chunks):
        out.append((ep.ProcessingRequest(response_body=ep.HttpBody(body=sse, end_of_stream=i == chunks - 1)), 1))
    return out
