"""The ext_proc flow, phase by phase, without gRPC."""

from __future__ import annotations

import json
import logging

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from modeldock.config import hash_key
from modeldock.extproc.flow import RequestFlow
from modeldock.gateway import Gateway
from modeldock.types import Endpoint
from tests.support.extproc_messages import body_request, headers_request, make_gateway, raw_headers

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
    return make_gateway(CONFIG, {"llama-8b": ["10.0.0.1:8000", "10.0.0.2:8000"], "llama-70b": ["10.0.0.3:8000"]})


def headers(*pairs: tuple[str, str], end: bool = False) -> ep.ProcessingRequest:
    return headers_request(raw_headers(*pairs), end_of_stream=end)


def post(payload: object | bytes, path: str = "/v1/chat/completions", key: str | None = KEY,
         method: str = "POST", authorization: str | None = None) -> ep.ProcessingRequest:
    """The buffered body, with the request attributes Envoy sends beside it."""
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    if authorization is None and key is not None:
        authorization = f"Bearer {key}"
    return body_request(raw, method=method, path=path, request_id="r1", authorization=authorization)


def status_of(resp: ep.ProcessingResponse) -> int:
    assert resp.WhichOneof("response") == "immediate_response"
    return resp.immediate_response.status.code


def error_of(resp: ep.ProcessingResponse) -> dict:
    return json.loads(resp.immediate_response.body)["error"]


def set_headers(common: ep.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def route_of(resp: ep.ProcessingResponse) -> tuple[str, str]:
    """The cluster and endpoint list ext_proc hands Envoy as dynamic metadata."""
    assert resp.WhichOneof("response") == "request_body"
    md = resp.dynamic_metadata
    return md["modeldock"]["cluster"], md["envoy.lb"]["x-gateway-destination-endpoint"]


async def test_happy_path_picks_and_counts(gateway: Gateway) -> None:
    flow = RequestFlow(gateway)
    r = await flow.handle(post({"model": "llama-8b", "messages": []}))
    common = r.request_body.response
    cluster, endpoints = route_of(r)
    assert cluster == "model:llama-8b"
    primary, fallback = endpoints.split(",")
    assert {primary, fallback} == {"10.0.0.1:8000", "10.0.0.2:8000"}
    # Envoy clears the route cache only for a response that carries a header mutation.
    assert common.clear_route_cache and common.HasField("header_mutation")
    assert not common.header_mutation.set_headers and not common.HasField("body_mutation")
    assert "content_length" not in r.dynamic_metadata["modeldock"]
    assert gateway.picker.total_in_flight() == 1
    assert r.dynamic_metadata["modeldock"]["model"] == "llama-8b"  # named in Envoy's own error replies
    assert flow.outcome == "proxied" and not flow.retried
    # Envoy reports a retry onto the fallback: the count moves with it.
    flow.retried_on(fallback)
    assert flow.retried and flow.served_by == fallback
    assert gateway.picker.in_flight(Endpoint.parse(fallback)) == 1
    assert gateway.picker.in_flight(Endpoint.parse(primary)) == 0
    # A third attempt back on the primary (the fallback policy's pick) moves it again.
    flow.retried_on(primary)
    assert gateway.picker.in_flight(Endpoint.parse(primary)) == 1
    assert gateway.picker.in_flight(Endpoint.parse(fallback)) == 0
    flow.finish()
    flow.finish()
    assert gateway.picker.total_in_flight() == 0
    # A report that comes after the stream ended changes nothing.
    flow.retried_on(fallback)
    assert gateway.picker.total_in_flight() == 0


async def test_a_retry_report_before_routing_or_to_a_bad_address_is_ignored(gateway: Gateway) -> None:
    flow = RequestFlow(gateway)
    flow.retried_on("10.0.0.2:8000")  # nothing routed yet
    assert not flow.retried and gateway.picker.total_in_flight() == 0
    r = await flow.handle(post({"model": "llama-8b"}))
    primary = route_of(r)[1].split(",")[0]
    flow.retried_on("not-an-address")
    assert gateway.picker.in_flight(Endpoint.parse(primary)) == 1
    flow.finish()
    assert gateway.picker.total_in_flight() == 0


async def test_alias_rewrites_body_for_backend(gateway: Gateway) -> None:
    flow = RequestFlow(gateway)
    r = await flow.handle(post({"model": "llama-70b", "prompt": "hi"}))
    rewritten = r.request_body.response.body_mutation.body
    assert json.loads(rewritten) == {"model": "meta/llama-70b", "prompt": "hi"}
    assert r.dynamic_metadata["modeldock"]["content_length"] == str(len(rewritten))
    assert route_of(r)[0] == "model:llama-70b"
    flow.finish()


OK = {"model": "llama-8b"}


@pytest.mark.parametrize(
    ("first", "status", "code"),
    [
        (post(OK, key=None), 401, "missing_api_key"),
        (post(OK, key="wrong"), 401, "invalid_api_key"),
        (post(OK, authorization="Basic abc"), 401, "invalid_authorization"),
        (post(OK, authorization=""), 401, "missing_api_key"),
        # Envoy joins repeated headers with a comma.
        (post(OK, authorization=f"Bearer {KEY},Bearer {KEY}"), 401, "invalid_authorization"),
        (post(OK, path="/v1/embeddings"), 404, "unknown_url"),
        (post(OK, method="PUT"), 400, "method_not_allowed"),
        (post(b"not json"), 400, "invalid_json"),
        (post(b"\xff\xfe"), 400, "invalid_body"),
        (post([1, 2]), 400, "invalid_body"),
        (post({"messages": []}), 400, "missing_model"),
        (post({"model": 7}), 400, "invalid_model"),
        (post({"model": "llama\r\n-8b"}), 400, "invalid_model"),
        # Outside the allowlist reads like unknown: a key cannot learn which models exist.
        (post({"model": "mistral"}), 404, "model_not_found"),
        (post({"model": "nope"}), 404, "model_not_found"),
        (post(b'{"model": "mistral", "model": "llama-8b"}'), 400, "duplicate_key"),
        (post({"model": "llama-8b", "pad": "x" * 3000}), 413, "request_too_large"),
    ],
)
async def test_rejections(gateway: Gateway, first: ep.ProcessingRequest, status: int, code: str) -> None:
    flow = RequestFlow(gateway)
    resp = await flow.handle(first)
    assert status_of(resp) == status
    err = error_of(resp)
    assert err["code"] == code and err["message"] and err["type"]
    assert KEY not in resp.immediate_response.body.decode()
    assert flow.outcome == "rejected" and flow.status == status
    flow.finish()
    assert gateway.picker.total_in_flight() == 0


async def test_models_lists_only_allowed(gateway: Gateway) -> None:
    flow = RequestFlow(gateway)
    resp = await flow.handle(
        headers((":method", "GET"), (":path", "/v1/models"), ("authorization", f"Bearer {KEY}"), end=True)
    )
    assert status_of(resp) == 200
    assert [m["id"] for m in json.loads(resp.immediate_response.body)["data"]] == ["llama-8b", "llama-70b"]


@pytest.mark.parametrize(
    ("pairs", "status", "code"),
    [
        (((":method", "GET"), (":path", "/v1/models")), 401, "missing_api_key"),
        (((":method", "POST"), (":path", "/v1/models"), ("authorization", f"Bearer {KEY}")), 400,
         "method_not_allowed"),
        # Only /v1/models sends its headers; a completion's headers mean Envoy is misconfigured.
        (((":method", "POST"), (":path", "/v1/chat/completions"), ("authorization", f"Bearer {KEY}")), 400,
         "invalid_request"),
    ],
)
async def test_request_headers_only_for_models(gateway: Gateway, pairs: tuple[tuple[str, str], ...], status: int,
                                               code: str) -> None:
    resp = await RequestFlow(gateway).handle(headers(*pairs))
    assert status_of(resp) == status
    assert error_of(resp)["code"] == code


@pytest.mark.parametrize("kind", ["request_trailers", "response_headers", "response_body", "response_trailers"])
async def test_anything_but_a_body_first_is_refused(gateway: Gateway, kind: str) -> None:
    msg = ep.ProcessingRequest()
    getattr(msg, kind).SetInParent()
    resp = await RequestFlow(gateway).handle(msg)
    assert status_of(resp) == 400
    assert gateway.picker.total_in_flight() == 0


async def test_stale_model_gets_503_with_reason(gateway: Gateway) -> None:
    gateway.on_status(frozenset({"llama-8b"}))
    flow = RequestFlow(gateway)
    resp = await flow.handle(post({"model": "llama-8b"}))
    assert status_of(resp) == 503
    assert error_of(resp)["code"] == "endpoint_snapshot_stale"
    assert "stale" in error_of(resp)["message"]


async def test_no_endpoints_gets_503(gateway: Gateway) -> None:
    gateway.on_endpoints("llama-8b", ())
    flow = RequestFlow(gateway)
    assert status_of(await flow.handle(post({"model": "llama-8b"}))) == 503


async def test_rate_limit_429_with_headers_and_concurrency_released_at_end() -> None:
    data = dict(CONFIG, tenants=[{"id": "acme", "api_key_hashes": [hash_key(KEY)], "models": ["llama-*"],
                                  "requests_per_minute": 2, "max_in_flight": 1}])
    gw = make_gateway(data, {"llama-8b": ["10.0.0.1:8000"]})
    admission = gw.admission

    async def start() -> tuple[RequestFlow, ep.ProcessingResponse]:
        flow = RequestFlow(gw)
        return flow, await flow.handle(post({"model": "llama-8b"}))

    first, r1 = await start()
    assert r1.WhichOneof("response") == "request_body"
    # Envoy adds the x-ratelimit-* headers to the response from the route metadata.
    assert r1.dynamic_metadata["modeldock"]["x-ratelimit-limit-requests"] == "2"
    assert r1.dynamic_metadata["modeldock"]["x-ratelimit-remaining-requests"] == "1"
    # A second concurrent request is over max_in_flight.
    second, r2 = await start()
    assert status_of(r2) == 429
    second.finish()
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


async def test_a_request_that_cannot_be_served_keeps_its_rate_limit_quota() -> None:
    data = dict(CONFIG, tenants=[{"id": "acme", "api_key_hashes": [hash_key(KEY)], "models": ["llama-*"],
                                  "requests_per_minute": 1}])
    gw = make_gateway(data, {})
    # No endpoints yet, then a stale snapshot: both 503, neither counted against the minute's 1 request.
    assert error_of(await RequestFlow(gw).handle(post({"model": "llama-8b"})))["code"] == "no_ready_endpoints"
    gw.on_endpoints("llama-8b", (Endpoint("10.0.0.1", 8000),))
    gw.on_status(frozenset({"llama-8b"}))
    assert error_of(await RequestFlow(gw).handle(post({"model": "llama-8b"})))["code"] == "endpoint_snapshot_stale"
    gw.on_status(frozenset())
    flow = RequestFlow(gw)
    assert route_of(await flow.handle(post({"model": "llama-8b"})))[0] == "model:llama-8b"
    flow.finish()
    assert error_of(await RequestFlow(gw).handle(post({"model": "llama-8b"})))["code"] == "rate_limit_exceeded"


async def test_unknown_and_forbidden_models_get_one_answer_and_the_log_keeps_why(
        gateway: Gateway, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "modeldock.extproc")
    unknown = await RequestFlow(gateway).handle(post({"model": "nope"}))
    forbidden = await RequestFlow(gateway).handle(post({"model": "mistral"}))
    assert status_of(unknown) == status_of(forbidden) == 404
    assert error_of(unknown)["message"] == "The model `nope` does not exist or you do not have access to it."
    assert error_of(forbidden) == {
        **error_of(unknown), "message": error_of(unknown)["message"].replace("nope", "mistral")
    }
    lines = [r.getMessage() for r in caplog.records]
    assert any("r1" in line and "unknown model" in line for line in lines), lines
    assert any("r1" in line and "allowlist" in line and "acme" in line for line in lines), lines
