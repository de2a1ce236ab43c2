"""The ext_proc flow, phase by phase, without gRPC."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from modeldock.admission.limits import Admission
from modeldock.clock import FakeClock
from modeldock.config import hash_key, parse_config
from modeldock.discovery.snapshot import Endpoint
from modeldock.extproc.flow import RequestFlow
from modeldock.extproc.gateway import Gateway
from modeldock.picking import Picker

KEY = "k-acme"
CONFIG = {
    "tenants": [{"id": "acme", "api_key_hashes": [hash_key(KEY)], "models": ["llama-*"]}],
    "models": [
        {"name": "llama-8b", "endpoints": ["10.0.0.1:8000", "10.0.0.2:8000"]},
        {"name": "llama-70b", "served_name": "meta/llama-70b", "endpoints": ["10.0.0.3:8000"]},
        {"name": "mistral", "endpoints": ["10.0.0.4:8000"]},
    ],
    "limits": {"max_body_bytes": 2048},
}


@pytest.fixture
def gateway() -> Gateway:
    clock = FakeClock()
    config = parse_config(CONFIG)
    gw = Gateway(config, clock, Picker(clock), Admission(config, clock))
    gw.on_endpoints("llama-8b", (Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)))
    gw.on_endpoints("llama-70b", (Endpoint("10.0.0.3", 8000),))
    return gw


def headers(*pairs: tuple[str, str], end: bool = False) -> ep.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm, end_of_stream=end))


def post(path: str = "/v1/chat/completions", key: str | None = KEY, *extra: tuple[str, str]) -> ep.ProcessingRequest:
    pairs = [(":method", "POST"), (":path", path), ("x-request-id", "r1")]
    if key is not None:
        pairs.append(("authorization", f"Bearer {key}"))
    return headers(*pairs, *extra)


def body(payload: object | bytes) -> ep.ProcessingRequest:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=True))


def status_of(resp: ep.ProcessingResponse) -> int:
    assert resp.WhichOneof("response") == "immediate_response"
    return resp.immediate_response.status.code


def error_of(resp: ep.ProcessingResponse) -> dict:
    return json.loads(resp.immediate_response.body)["error"]


def set_headers(common: ep.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


async def test_happy_path_picks_strips_and_counts(gateway: Gateway) -> None:
    flow = RequestFlow(gateway)
    r1 = await flow.handle(post("/v1/chat/completions", KEY, ("x-gateway-destination-endpoint", "6.6.6.6:1")))
    assert r1.WhichOneof("response") == "request_headers"
    removed = set(r1.request_headers.response.header_mutation.remove_headers)
    assert {"authorization", "x-gateway-destination-endpoint", "x-modeldock-cluster"} <= removed
    r2 = await flow.handle(body({"model": "llama-8b", "messages": []}))
    common = r2.request_body.response
    hdrs = set_headers(common)
    assert hdrs["x-modeldock-cluster"] == "model:llama-8b"
    primary, fallback = hdrs["x-gateway-destination-endpoint"].split(",")
    assert {primary, fallback} == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert common.clear_route_cache
    assert gateway.picker.total_in_flight() == 1
    # Envoy retried onto the fallback: the count moves with it.
    attrs = struct_pb2.Struct()
    attrs.update({"upstream.address": fallback})
    resp = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])))
    resp.attributes["envoy.filters.http.ext_proc"].CopyFrom(attrs)
    await flow.handle(resp)
    assert gateway.picker.in_flight(Endpoint.parse(fallback)) == 1
    assert gateway.picker.in_flight(Endpoint.parse(primary)) == 0
    flow.finish()
    flow.finish()
    assert gateway.picker.total_in_flight() == 0


async def test_alias_rewrites_body_for_backend(gateway: Gateway) -> None:
    flow = RequestFlow(gateway)
    await flow.handle(post())
    r = await flow.handle(body({"model": "llama-70b", "prompt": "hi"}))
    rewritten = json.loads(r.request_body.response.body_mutation.body)
    assert rewritten == {"model": "meta/llama-70b", "prompt": "hi"}
    assert set_headers(r.request_body.response)["content-length"] == str(len(r.request_body.response.body_mutation.body))
    flow.finish()


@pytest.mark.parametrize(
    ("first", "second", "status", "code"),
    [
        (post(key=None), None, 401, "missing_api_key"),
        (post(key="wrong"), None, 401, "invalid_api_key"),
        (headers((":method", "POST"), (":path", "/v1/completions"), ("authorization", "Basic abc")), None, 401,
         "invalid_authorization"),
        (headers((":method", "POST"), (":path", "/v1/completions"), ("authorization", f"Bearer {KEY}"),
                 ("authorization", f"Bearer {KEY}")), None, 401, "invalid_authorization"),
        (post("/v1/embeddings"), None, 404, "unknown_url"),
        (post(), body(b"not json"), 400, "invalid_json"),
        (post(), body(b"\xff\xfe"), 400, "invalid_body"),
        (post(), body([1, 2]), 400, "invalid_body"),
        (post(), body({"messages": []}), 400, "missing_model"),
        (post(), body({"model": 7}), 400, "invalid_model"),
        (post(), body({"model": "llama\r\n-8b"}), 400, "invalid_model"),
        (post(), body({"model": "mistral"}), 403, "model_not_allowed"),
        (post(), body({"model": "nope"}), 404, "model_not_found"),
        (post(), body({"model": "llama-8b", "pad": "x" * 3000}), 413, "request_too_large"),
        (post("/v1/chat/completions", KEY, ("content-length", "999999")), None, 413, "request_too_large"),
    ],
)
async def test_rejections(gateway: Gateway, first, second, status: int, code: str) -> None:
    flow = RequestFlow(gateway)
    resp = await flow.handle(first)
    if second is not None:
        assert resp.WhichOneof("response") == "request_headers"
        resp = await flow.handle(second)
    assert status_of(resp) == status
    err = error_of(resp)
    assert err["code"] == code and err["message"] and err["type"]
    assert KEY not in resp.immediate_response.body.decode()
    flow.finish()
    assert gateway.picker.total_in_flight() == 0


async def test_models_lists_only_allowed(gateway: Gateway) -> None:
    flow = RequestFlow(gateway)
    resp = await flow.handle(headers((":method", "GET"), (":path", "/v1/models"), ("authorization", f"Bearer {KEY}"), end=True))
    assert status_of(resp) == 200
    assert [m["id"] for m in json.loads(resp.immediate_response.body)["data"]] == ["llama-8b", "llama-70b"]


async def test_body_before_headers_is_refused(gateway: Gateway) -> None:
    resp = await RequestFlow(gateway).handle(body({"model": "llama-8b"}))
    assert status_of(resp) == 400
    assert gateway.picker.total_in_flight() == 0


async def test_stale_model_gets_503_with_reason(gateway: Gateway) -> None:
    gateway.on_status(frozenset({"llama-8b"}))
    flow = RequestFlow(gateway)
    await flow.handle(post())
    resp = await flow.handle(body({"model": "llama-8b"}))
    assert status_of(resp) == 503
    assert error_of(resp)["code"] == "endpoint_snapshot_stale"
    assert "stale" in error_of(resp)["message"]


async def test_no_endpoints_gets_503(gateway: Gateway) -> None:
    gateway.on_endpoints("llama-8b", ())
    flow = RequestFlow(gateway)
    await flow.handle(post())
    assert status_of(await flow.handle(body({"model": "llama-8b"}))) == 503


async def test_rate_limit_429_with_headers_and_concurrency_released_at_end() -> None:
    clock = FakeClock()
    data = dict(CONFIG, tenants=[{"id": "acme", "api_key_hashes": [hash_key(KEY)], "models": ["llama-*"],
                                  "requests_per_minute": 2, "max_in_flight": 1}])
    config = parse_config(data)
    admission = Admission(config, clock)
    gw = Gateway(config, clock, Picker(clock), admission)
    gw.on_endpoints("llama-8b", (Endpoint("10.0.0.1", 8000),))

    async def start() -> tuple[RequestFlow, ep.ProcessingResponse]:
        flow = RequestFlow(gw)
        await flow.handle(post())
        return flow, await flow.handle(body({"model": "llama-8b"}))

    first, r1 = await start()
    assert r1.WhichOneof("response") == "request_body"
    # A second concurrent request is over max_in_flight.
    second, r2 = await start()
    assert status_of(r2) == 429
    second.finish()
    # Response headers carry the x-ratelimit-* headers.
    resp = await first.handle(ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")]))))
    added = set_headers(resp.response_headers.response)
    assert added["x-ratelimit-limit-requests"] == "2"
    assert added["x-ratelimit-remaining-requests"] == "1"
    first.finish()
    assert admission.in_flight("acme") == 0 and gw.picker.total_in_flight() == 0
    third, _ = await start()
    third.finish()
    fourth, r4 = await start()
    assert status_of(r4) == 429
    assert error_of(r4)["code"] == "rate_limit_exceeded"
    hdrs = {h.header.key: h.header.raw_value.decode() for h in r4.immediate_response.headers.set_headers}
    assert int(hdrs["retry-after"]) >= 1
    assert hdrs["x-ratelimit-remaining-requests"] == "0"
    fourth.finish()
    assert admission.in_flight("acme") == 0
