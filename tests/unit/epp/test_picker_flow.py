"""Picker mode's adapter (modeldock/epp/flow.py), message by message as a gateway's Envoy sends them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from modeldock.config import hash_key
from modeldock.epp import PickerFlow, PickerOptions
from modeldock.epp.protocol import SERVED_KEY, SUBSET_KEY
from modeldock.gateway import Gateway
from modeldock.gateway.lifecycle import Lifecycle, NoHooks, Outcome
from modeldock.types import Endpoint
from tests.support.extproc_messages import headers_request, make_gateway, raw_headers

KEY = "k-acme"
A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
CONFIG: dict[str, Any] = {
    "tenants": [{"id": "acme", "api_key_hashes": [hash_key(KEY)], "models": ["llama-*"], "max_in_flight": 2,
                 "requests_per_minute": 100}],
    "models": [{"name": "llama-8b", "endpoints": [A, B, C]},
               {"name": "llama-alias", "served_name": "meta/llama", "endpoints": [A]}],
    "limits": {"max_body_bytes": 4096},
}
DUPLEX, BUFFERED = pm.ProcessingMode.FULL_DUPLEX_STREAMED, pm.ProcessingMode.BUFFERED
BODY = json.dumps({"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}]}).encode()
# What a client may send that no backend may see (envoy/bootstrap.yaml strips the same, and x-envoy-*).
CLIENT_ONLY = (("x-gateway-destination-endpoint", "6.6.6.6:80"), ("x-modeldock-cluster", "x"),
               ("x-modeldock-rid", "forged"), ("proxy-authorization", "Basic cA=="), ("api-key", "secret"),
               ("x-api-key", "secret"), ("cookie", "session=1"), ("x-priority", "standard"),
               (SUBSET_KEY, A), (SERVED_KEY, A))


@pytest.fixture
def gateway() -> Gateway:
    return make_gateway(CONFIG, {"llama-8b": [A, B, C], "llama-alias": [A]}, seed=1)


def start(*extra: tuple[str, str], path: str = "/v1/chat/completions", method: str = "POST", key: str | None = KEY,
          mode: int = DUPLEX, end: bool = False, lb: dict[str, Any] | None = None) -> ep.ProcessingRequest:
    pairs = [(":method", method), (":path", path), ("x-request-id", "r1"), *extra]
    if key is not None:
        pairs.append(("authorization", f"Bearer {key}"))
    msg = headers_request(raw_headers(*pairs), end_of_stream=end)
    msg.protocol_config.request_body_mode = mode  # type: ignore[assignment]
    msg.protocol_config.response_body_mode = mode  # type: ignore[assignment]
    if lb is not None:
        msg.metadata_context.filter_metadata["envoy.lb"].update(lb)
    return msg


def chunk(data: bytes, end: bool = True, field: str = "request_body") -> ep.ProcessingRequest:
    return ep.ProcessingRequest(**{field: ep.HttpBody(body=data, end_of_stream=end)})


async def run(flow: PickerFlow, *messages: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
    out: list[ep.ProcessingResponse] = []
    for message in messages:
        out.extend(await flow.handle(message))
    return out


def mutation(common: ep.CommonResponse) -> tuple[dict[str, str], list[str]]:
    m = common.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in m.set_headers}, list(m.remove_headers)


def lb_destination(response: ep.ProcessingResponse) -> str:
    lb = response.dynamic_metadata.fields["envoy.lb"].struct_value
    return lb.fields["x-gateway-destination-endpoint"].string_value


def error(response: ep.ProcessingResponse) -> tuple[int, dict[str, Any]]:
    assert response.WhichOneof("response") == "immediate_response"
    imm = response.immediate_response
    return imm.status.code, json.loads(imm.body)["error"]


def streamed(responses: Sequence[ep.ProcessingResponse], kind: str = "request_body") -> tuple[bytes, bool]:
    parts = [
        getattr(r, kind).response.body_mutation.streamed_response
        for r in responses
        if r.WhichOneof("response") == kind
    ]
    return b"".join(p.body for p in parts), parts[-1].end_of_stream


async def test_duplex_holds_the_headers_answer_until_the_body_is_in_then_routes_in_header_and_metadata(
        gateway: Gateway) -> None:
    flow = PickerFlow(gateway)
    assert await flow.handle(start(*CLIENT_ONLY)) == []
    assert await flow.handle(chunk(BODY[:10], end=False)) == []
    out = await flow.handle(chunk(BODY[10:]))
    assert out[0].WhichOneof("response") == "request_headers"
    common = out[0].request_headers.response
    assert common.clear_route_cache
    set_, removed = mutation(common)
    primary = set_["x-gateway-destination-endpoint"]
    assert primary in (A, B, C) and "," not in primary  # one endpoint by default: ORIGINAL_DST takes one
    assert lb_destination(out[0]) == primary  # header and metadata never differ
    assert set_["content-length"] == str(len(BODY))
    # Every header the bootstrap strips (but x-envoy-*, the gateway's) goes no further: removed, or the
    # destination, set (overwriting the client's) rather than removed.
    assert "x-gateway-destination-endpoint" not in removed and primary != "6.6.6.6:80"
    for name in ("authorization", *(name for name, _ in CLIENT_ONLY)):
        assert name in removed or name == "x-gateway-destination-endpoint", name
    assert streamed(out[1:]) == (BODY, True)
    assert gateway.picker.in_flight(Endpoint.parse(primary)) == 1
    flow.finish()
    flow.finish()
    assert gateway.picker.total_in_flight() == 0
    assert (flow.outcome, flow.status) == ("proxied", 0)


async def test_list_mode_answers_primary_then_fallbacks_in_both_places(gateway: Gateway) -> None:
    flow = PickerFlow(gateway, PickerOptions(fallbacks=True))
    out = await run(flow, start(), chunk(BODY))
    listed = mutation(out[0].request_headers.response)[0]["x-gateway-destination-endpoint"].split(",")
    assert len(listed) == 3 and set(listed) == {A, B, C}
    assert lb_destination(out[0]) == ",".join(listed)
    flow.finish()


async def test_a_rejected_key_gets_its_401_json_and_holds_nothing(gateway: Gateway) -> None:
    flow = PickerFlow(gateway)
    out = await run(flow, start(key="wrong"), chunk(BODY))
    status, body = error(out[0])
    assert status == 401 and body["type"] == "invalid_request_error" and body["code"] == "invalid_api_key"
    assert flow.routed is None and gateway.picker.total_in_flight() == 0
    assert (flow.outcome, flow.status) == ("rejected", 401)


async def test_shedding_is_a_429_with_openai_json(gateway: Gateway) -> None:
    flows = [PickerFlow(gateway) for _ in range(3)]
    for flow in flows[:2]:
        await run(flow, start(), chunk(BODY))
    status, body = error((await run(flows[2], start(), chunk(BODY)))[0])
    assert status == 429 and body["type"] == "rate_limit_error"
    for flow in flows:
        flow.finish()
    assert gateway.picker.total_in_flight() == 0


async def test_the_subset_hint_limits_the_pick_and_an_empty_or_foreign_one_is_a_503(gateway: Gateway) -> None:
    for _ in range(4):
        flow = PickerFlow(gateway, PickerOptions(fallbacks=True))
        out = await run(flow, start(lb={SUBSET_KEY: [B, "not-an-address"]}), chunk(BODY))
        assert lb_destination(out[0]) == B
        flow.finish()
    for hint in ([], ["10.9.9.9:1"]):
        flow = PickerFlow(gateway)
        out = await run(flow, start(lb={SUBSET_KEY: hint}), chunk(BODY))
        status, body = error(out[0])
        assert status == 503 and body["code"] == "no_ready_endpoints"
    assert gateway.picker.total_in_flight() == 0


async def test_the_served_endpoint_report_moves_the_in_flight_count(gateway: Gateway) -> None:
    retries: list[int] = []

    class Hooks(NoHooks):
        def on_retried(self, request: Outcome) -> None:
            retries.append(1)

    lifecycle = Lifecycle(gateway, Hooks(), await_reports=False)
    flow = PickerFlow(gateway, PickerOptions(fallbacks=True), lifecycle=lifecycle)
    out = await run(flow, start(), chunk(BODY))
    primary, fallback = lb_destination(out[0]).split(",")[:2]
    response = headers_request(raw_headers((":status", "200"), ("server", "vllm")), end_of_stream=False,
                               field="response_headers")
    response.metadata_context.filter_metadata["envoy.lb"].update({SERVED_KEY: fallback})
    answer = (await flow.handle(response))[0]
    set_, removed = mutation(answer.response_headers.response)
    assert set_["x-ratelimit-limit-requests"] == "100" and "server" in removed
    assert gateway.picker.in_flight(Endpoint.parse(fallback)) == 1
    assert gateway.picker.in_flight(Endpoint.parse(primary)) == 0
    assert retries == [1] and flow.served_by == fallback
    flow.finish()
    assert gateway.picker.total_in_flight() == 0


async def test_response_chunks_are_echoed_in_duplex(gateway: Gateway) -> None:
    flow = PickerFlow(gateway)
    await run(flow, start(), chunk(BODY))
    out = await run(flow, chunk(b"data: 1\n\n", end=False, field="response_body"),
                    chunk(b"data: [DONE]\n\n", field="response_body"))
    assert streamed(out, "response_body") == (b"data: 1\n\ndata: [DONE]\n\n", True)
    assert len(out) == 2
    flow.finish()


async def test_buffered_answers_headers_at_once_and_routes_in_the_body_answer_with_the_rewrite(
        gateway: Gateway) -> None:
    flow = PickerFlow(gateway)
    body = json.dumps({"model": "llama-alias", "messages": []}).encode()
    first = await flow.handle(start(mode=BUFFERED))
    assert [r.WhichOneof("response") for r in first] == ["request_headers"]
    out = await flow.handle(chunk(body))
    assert [r.WhichOneof("response") for r in out] == ["request_body"]
    common = out[0].request_body.response
    sent = common.body_mutation.body
    assert json.loads(sent)["model"] == "meta/llama"
    set_, removed = mutation(common)
    assert set_["x-gateway-destination-endpoint"] == A == lb_destination(out[0])
    assert set_["content-length"] == str(len(sent)) and "authorization" in removed
    answer = await flow.handle(chunk(b"{}", field="response_body"))
    assert answer[0].response_body == ep.BodyResponse()  # buffered: passed on unchanged
    flow.finish()


async def test_bodies_over_the_limit_get_413_as_chunks_arrive_or_from_content_length(gateway: Gateway) -> None:
    flow = PickerFlow(gateway)
    out = await run(flow, start(), chunk(b"x" * 3000, end=False), chunk(b"x" * 3000, end=False))
    assert error(out[0])[0] == 413 and flow._chunks == []
    flow = PickerFlow(gateway)
    assert error((await flow.handle(start(("content-length", "5000"))))[0])[0] == 413


def sized(size: int) -> bytes:
    """A valid request body of exactly `size` bytes."""
    body = json.dumps({"model": "llama-8b", "messages": [{"role": "user", "content": ""}]}).encode()
    return body.replace(b'"content": ""', b'"content": "' + b"x" * (size - len(body)) + b'"')


async def test_the_413_bound_is_exact_a_body_of_the_limit_goes_and_one_byte_more_does_not(gateway: Gateway) -> None:
    limit = CONFIG["limits"]["max_body_bytes"]
    at, over = sized(limit), sized(limit + 1)
    assert (len(at), len(over)) == (limit, limit + 1)
    flow = PickerFlow(gateway)
    out = await run(flow, start(("content-length", str(limit))), chunk(at[:100], end=False), chunk(at[100:]))
    assert out[0].WhichOneof("response") == "request_headers" and streamed(out[1:]) == (at, True)
    flow.finish()
    # One byte over: refused as the chunk arrives (before the end of the body), not by the director.
    flow = PickerFlow(gateway)
    assert await run(flow, start(), chunk(over[:100], end=False)) == []
    status, body = error((await flow.handle(chunk(over[100:], end=False)))[0])
    assert status == 413 and body["code"] == "request_too_large" and flow.routed is None
    flow = PickerFlow(gateway)
    assert error((await flow.handle(start(("content-length", str(limit + 1)))))[0])[0] == 413
    assert gateway.picker.total_in_flight() == 0


async def test_x_priority_decides_the_class_as_in_the_bootstrap_and_a_class_not_allowed_is_a_400() -> None:
    config = {**CONFIG, "tenants": [{**CONFIG["tenants"][0], "priorities_allowed": ["batch"]}]}
    gw = make_gateway(config, {"llama-8b": [A, B, C]}, seed=1)
    flow = PickerFlow(gw)
    status, body = error((await run(flow, start(("x-priority", "interactive")), chunk(BODY)))[0])
    assert status == 400 and body["code"] == "priority_not_allowed"
    assert gw.picker.total_in_flight() == 0 and flow.routed is None
    # Repeated, the header reads as Envoy's attribute does ("batch,batch"): not a class either.
    flow = PickerFlow(gw)
    out = await run(flow, start(("x-priority", "batch"), ("x-priority", "batch")), chunk(BODY))
    assert error(out[0])[1]["code"] == "priority_not_allowed"
    flow = PickerFlow(gw)
    out = await run(flow, start(("x-priority", " batch ")), chunk(BODY))
    assert flow.head is not None and flow.head.priority == "batch"
    assert "x-priority" in mutation(out[0].request_headers.response)[1]  # read here; the backend never sees it
    flow.finish()


async def test_models_unknown_paths_methods_and_empty_bodies_are_answered_from_the_headers(gateway: Gateway) -> None:
    flow = PickerFlow(gateway)
    out = await flow.handle(start(path="/v1/models", method="GET", end=True))
    imm = out[0].immediate_response
    assert imm.status.code == 200 and [m["id"] for m in json.loads(imm.body)["data"]] == ["llama-8b", "llama-alias"]
    assert error((await PickerFlow(gateway).handle(start(path="/admin", end=True)))[0])[0] == 404
    assert error((await PickerFlow(gateway).handle(start(method="GET", end=True)))[0])[0] == 400
    status, body = error((await PickerFlow(gateway).handle(start(end=True)))[0])
    assert status == 400 and body["code"] == "invalid_body"


async def test_request_trailers_end_the_body(gateway: Gateway) -> None:
    flow = PickerFlow(gateway)
    out = await run(flow, start(), chunk(BODY, end=False), ep.ProcessingRequest(request_trailers=ep.HttpTrailers()))
    kinds = [r.WhichOneof("response") for r in out]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    assert streamed(out) == (BODY, False)
    flow.finish()


async def test_a_body_before_headers_or_a_mode_without_bodies_is_a_503_not_a_route(gateway: Gateway) -> None:
    status, body = error((await PickerFlow(gateway).handle(chunk(BODY)))[0])
    assert status == 503 and body["code"] == "gateway_misconfigured"
    status, body = error((await PickerFlow(gateway).handle(start(mode=pm.ProcessingMode.NONE)))[0])
    assert status == 503 and body["code"] == "gateway_misconfigured"


async def test_the_model_credential_replaces_the_clients_and_is_not_removed() -> None:
    config = {**CONFIG, "models": [{"name": "llama-8b", "endpoints": [A],
                                    "upstream_auth": {"env": "EPP_TEST_KEY", "header": "authorization"}}]}
    import os

    os.environ["EPP_TEST_KEY"] = "backend-secret"
    try:
        gateway = make_gateway(config, {"llama-8b": [A]})
    finally:
        del os.environ["EPP_TEST_KEY"]
    flow = PickerFlow(gateway)
    out = await run(flow, start(), chunk(BODY))
    set_, removed = mutation(out[0].request_headers.response)
    assert set_["authorization"] == "Bearer backend-secret" and "authorization" not in removed
    flow.finish()


def test_the_subset_hint_reads_a_list_or_a_comma_string() -> None:
    from modeldock.epp.protocol import subset_endpoints

    value = struct_pb2.Value(string_value=f"{A}, {B}")
    assert subset_endpoints(value) == {Endpoint.parse(A), Endpoint.parse(B)}
    assert subset_endpoints(struct_pb2.Value(number_value=1)) == frozenset()


async def test_a_budgeted_request_is_charged_its_reservation_once_when_its_stream_ends() -> None:
    """Picker mode hears no usage report (the gateway's Envoy has no usage filters): the reservation is
    charged whole, once, and nothing stays held."""
    config = {**CONFIG, "tenants": [{**CONFIG["tenants"][0], "tokens_per_minute": 100_000}]}
    gw = make_gateway(config, {"llama-8b": [A, B, C], "llama-alias": [A]}, seed=1)
    flow = PickerFlow(gw)
    await run(flow, start(), chunk(BODY))
    routed = flow.routed
    assert routed is not None and routed.holdings.reservation is not None
    assert gw.budgets.held_count() == 1
    flow.finish()
    flow.finish()
    assert gw.budgets.held_count() == 0 and gw.picker.total_in_flight() == 0
    remaining = int(routed.holdings.reservation.headers["x-ratelimit-remaining-tokens"])
    # A second request sees the first one's whole reservation charged (not refunded).
    second = PickerFlow(gw)
    await run(second, start(), chunk(BODY))
    assert second.routed is not None and second.routed.holdings.reservation is not None
    left = int(second.routed.holdings.reservation.headers["x-ratelimit-remaining-tokens"])
    assert left == remaining - routed.holdings.reservation.tokens
    second.finish()
