"""modeldock_requests_total's tenant and model labels, through both adapters (ext_proc's own bootstrap and
picker mode), without gRPC: the configured names once the director knew them, never the client's text."""

from __future__ import annotations

import json
from typing import Any

import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from prometheus_client import CollectorRegistry

from modeldock.config import hash_key
from modeldock.epp import PickerFlow
from modeldock.errors import NotFound, Rejection
from modeldock.extproc.app import ExtProcMetrics
from modeldock.extproc.flow import RequestFlow
from modeldock.gateway import Gateway
from tests.support.extproc_messages import body_request, headers_request, make_gateway, raw_headers

KEY = "k-acme"
A, B = "10.0.0.1:8000", "10.0.0.2:8000"
CONFIG: dict[str, Any] = {
    "tenants": [{"id": "acme", "api_key_hashes": [hash_key(KEY)], "models": ["llama-*"], "max_in_flight": 1}],
    "models": [
        {"name": "llama-8b", "endpoints": [A]},
        {"name": "llama-alias", "served_name": "meta/llama", "endpoints": [B]},
        {"name": "llama-70b", "endpoints": []},  # no endpoints announced: 503 after the model resolved
        {"name": "mistral", "endpoints": [B]},  # not in acme's allowlist
    ],
    "limits": {"max_body_bytes": 2048},
}
Labels = tuple[str, str, str, str]  # outcome, status, tenant, model


@pytest.fixture
def gateway() -> Gateway:
    return make_gateway(CONFIG, {"llama-8b": [A], "llama-alias": [B], "mistral": [B]})


@pytest.fixture(params=["extproc", "picker"])
def adapter(request: pytest.FixtureRequest) -> str:
    return str(request.param)


Flow = RequestFlow | PickerFlow


def body(model: object, **extra: object) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


async def completion(adapter: str, gateway: Gateway, payload: bytes, key: str | None = KEY,
                     path: str = "/v1/chat/completions") -> Flow:
    """One completion request as the adapter's Envoy sends it; the flow is left open (finish it)."""
    authorization = f"Bearer {key}" if key is not None else None
    if adapter == "extproc":
        flow = RequestFlow(gateway)
        await flow.handle(body_request(payload, path=path, authorization=authorization))
        return flow
    picker = PickerFlow(gateway)
    pairs = [(":method", "POST"), (":path", path), ("x-request-id", "r1")]
    if authorization is not None:
        pairs.append(("authorization", authorization))
    start = headers_request(raw_headers(*pairs), end_of_stream=False)
    start.protocol_config.request_body_mode = pm.ProcessingMode.BUFFERED
    start.protocol_config.response_body_mode = pm.ProcessingMode.BUFFERED
    for message in (start, ep.ProcessingRequest(request_body=ep.HttpBody(body=payload, end_of_stream=True))):
        await picker.handle(message)
    return picker


async def models_list(adapter: str, gateway: Gateway, key: str | None = KEY) -> Flow:
    pairs = [(":method", "GET"), (":path", "/v1/models")]
    if key is not None:
        pairs.append(("authorization", f"Bearer {key}"))
    flow: Flow = RequestFlow(gateway) if adapter == "extproc" else PickerFlow(gateway)
    await flow.handle(headers_request(raw_headers(*pairs), end_of_stream=True))
    return flow


def series(registry: CollectorRegistry) -> dict[Labels, float]:
    """Every modeldock_requests_total series: (outcome, status, tenant, model) -> count."""
    found: dict[Labels, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "modeldock_requests_total":
                labels = sample.labels
                found[(labels["outcome"], labels["status"], labels["tenant"], labels["model"])] = sample.value
    return found


def counted(flow: Flow) -> Labels:
    """The one series a finished flow adds to a fresh registry."""
    flow.finish()
    registry = CollectorRegistry()
    ExtProcMetrics(registry).on_finished(flow, 0.01)
    [(labels, value)] = series(registry).items()
    assert value == 1
    return labels


def test_a_rejection_names_no_tenant_or_model_until_the_director_sets_them() -> None:
    rejection = NotFound("no such model")
    assert (rejection.tenant, rejection.model) == ("", "")
    assert (Rejection("x").tenant, Rejection("x").model) == ("", "")


@pytest.mark.parametrize(("payload", "key", "path", "expected"), [
    # Refused before the key authenticated: no tenant, whatever the body names.
    (body("llama-8b"), "wrong-key", "/v1/chat/completions", ("rejected", "401", "", "")),
    (body("llama-8b"), None, "/v1/chat/completions", ("rejected", "401", "", "")),
    (body("llama-8b"), KEY, "/v1/nope", ("rejected", "404", "", "")),
    # Authenticated, but the model never resolved: the tenant only.
    (body("no-such-model"), KEY, "/v1/chat/completions", ("rejected", "404", "acme", "")),
    (body("mistral"), KEY, "/v1/chat/completions", ("rejected", "404", "acme", "")),  # known, not allowed
    (b"{not json", KEY, "/v1/chat/completions", ("rejected", "400", "acme", "")),
    (body("llama\r\n-8b"), KEY, "/v1/chat/completions", ("rejected", "400", "acme", "")),
    # Refused after the model resolved: both.
    (body("llama-70b"), KEY, "/v1/chat/completions", ("rejected", "503", "acme", "llama-70b")),
], ids=["bad-key", "no-key", "unknown-path", "unknown-model", "model-not-allowed", "not-json", "bad-model-name",
        "no-endpoints"])
async def test_a_rejection_counts_under_what_the_director_knew(
        adapter: str, gateway: Gateway, payload: bytes, key: str | None, path: str, expected: Labels) -> None:
    flow = await completion(adapter, gateway, payload, key, path)
    assert counted(flow) == expected
    assert gateway.picker.total_in_flight() == 0


async def test_a_body_over_the_limit_counts_under_the_tenant_only_once_authenticated(
        adapter: str, gateway: Gateway) -> None:
    flow = await completion(adapter, gateway, body("llama-8b", pad="x" * 3000))
    # The director authenticates before it measures the body; picker mode measures it as it comes in,
    # before the director is asked, so no key has been checked yet.
    assert counted(flow) == ("rejected", "413", "acme" if adapter == "extproc" else "", "")


async def test_a_rate_limited_request_counts_under_its_tenant_and_model(adapter: str, gateway: Gateway) -> None:
    held = await completion(adapter, gateway, body("llama-8b"))  # acme's one in-flight slot
    shed = await completion(adapter, gateway, body("llama-8b"))
    assert shed.status == 429
    assert counted(shed) == ("rejected", "429", "acme", "llama-8b")
    assert counted(held) == ("proxied", "", "acme", "llama-8b")


async def test_a_proxied_request_counts_under_the_public_model_name(adapter: str, gateway: Gateway) -> None:
    flow = await completion(adapter, gateway, body("llama-alias"))
    assert flow.outcome == "proxied"
    # The name the config lists and the client asked for, not the backend's served name.
    assert counted(flow) == ("proxied", "", "acme", "llama-alias")


async def test_models_counts_under_its_tenant_and_no_model(adapter: str, gateway: Gateway) -> None:
    assert counted(await models_list(adapter, gateway)) == ("models", "200", "acme", "")
    assert counted(await models_list(adapter, gateway, key="wrong-key")) == ("rejected", "401", "", "")
    assert counted(await models_list(adapter, gateway, key=None)) == ("rejected", "401", "", "")


async def test_client_model_names_never_make_series(adapter: str, gateway: Gateway) -> None:
    registry = CollectorRegistry()
    metrics = ExtProcMetrics(registry)
    for i in range(1000):
        for payload in (body(f"unknown-{i}"), body(f"llama-{i}")):  # llama-* passes the allowlist: still unknown
            flow = await completion(adapter, gateway, payload)
            flow.finish()
            metrics.on_finished(flow, 0.01)
    assert series(registry) == {("rejected", "404", "acme", ""): 2000}
    proxied = await completion(adapter, gateway, body("llama-8b"))
    proxied.finish()
    metrics.on_finished(proxied, 0.01)
    assert len(series(registry)) == 2
