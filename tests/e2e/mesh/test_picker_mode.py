"""Picker mode end to end: real Envoy running the config each gateway generates (tests/e2e/mesh/),
modeldock's ext_proc as its endpoint picker, simulated model servers, the openai SDK as the client.

Envoy Gateway + Envoy AI Gateway: one endpoint per request in the x-gateway-destination-endpoint
header of an ORIGINAL_DST cluster, the picker over TLS. Istio: the ranked list in envoy.lb metadata
(override_host), retries down it, and the served endpoint reported back. Usage records are on: every
request is settled with the usage the picker reads from its response.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.stack import API_KEY, Sim, Stack, raw_request, running_stack, wait_until

pytestmark = pytest.mark.timeout(180)
MSG = [{"role": "user", "content": "hello there"}]
# envoy-gateway-buffered: the pool's body mode annotation set to `buffered` (both bodies BUFFERED).
GATEWAYS = ("envoy-gateway", "istio", "envoy-gateway-buffered")


def _config(data: dict[str, Any], sims: list[Sim]) -> None:
    # demo-model is served by the first two; the third serves only other-model, so a request that
    # lands on it for demo-model went where the client, not the picker, said.
    data["models"][0]["endpoints"] = [s.address for s in sims[:2]]
    data["models"][1]["endpoints"] = [sims[2].address]
    data["limits"] = {"max_body_bytes": 64 * 1024}


@pytest.fixture(scope="module", params=GATEWAYS)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    run_dir: Path = tmp_path_factory.mktemp(f"mesh-{request.param}")

    def edit(data: dict[str, Any], sims: list[Sim]) -> None:
        _config(data, sims)
        data["usage"] = {"path": str(run_dir / "usage.jsonl"), "replica": "picker", "fsync_interval_seconds": 0}

    with running_stack(run_dir, backends=3, mesh=request.param, edit_config=edit,
                       sim_args=("--speed", "20")) as stack:
        stack.mesh = request.param  # type: ignore[attr-defined]
        yield stack


def test_the_openai_sdk_streams_through_the_gateway(stack: Stack) -> None:
    pieces = []
    for chunk in stack.openai().chat.completions.create(model="demo-model", messages=MSG, max_tokens=20,
                                                        stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert len(pieces) > 3
    seen = [(s, r) for s in stack.sims[:2] for r in s.requests()]
    assert seen, "a demo-model backend got the request"
    sim, last = seen[-1]
    headers = {k.lower(): v for k, v in last["headers"]}
    assert "authorization" not in headers  # the client's key never reaches a model server
    assert headers["x-gateway-destination-endpoint"].split(",")[0] == sim.address
    wait_until(lambda: stack.in_flight() == 0, 5, what="in-flight released")
    assert stack.metric("modeldock_requests_total") >= 1


def test_a_rejected_key_gets_its_401_json(stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        stack.openai(api_key="md-wrong-key").chat.completions.create(model="demo-model", messages=MSG)
    assert caught.value.status_code == 401
    body = caught.value.response.json()
    assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"


def test_models_and_unknown_models_are_answered_by_the_picker(stack: Stack) -> None:
    assert [m.id for m in stack.openai().models.list()] == ["demo-model"]
    with pytest.raises(openai.NotFoundError) as caught:
        stack.openai().chat.completions.create(model="nope", messages=MSG)
    assert caught.value.response.json()["error"]["code"] == "model_not_found"


def requests_counted(stack: Stack) -> dict[tuple[str, str, str, str], float]:
    """modeldock_requests_total on ext_proc's page: (outcome, status, tenant, model) -> count."""
    url = f"http://127.0.0.1:{stack.extproc_metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 (loopback)
        page = resp.read().decode()
    return {(s.labels["outcome"], s.labels["status"], s.labels["tenant"], s.labels["model"]): s.value
            for family in text_string_to_metric_families(page) for s in family.samples
            if s.name == "modeldock_requests_total"}


def test_requests_count_under_the_tenant_and_model_the_picker_resolved(stack: Stack) -> None:
    # A request is counted when its ext_proc stream ends, which may come a little after the client has the
    # answer (an earlier test's): start from a quiet gateway.
    wait_until(lambda: stack.metric("modeldock_extproc_streams") == 0, 5, what="no ext_proc stream open")
    before = requests_counted(stack)
    stack.openai().chat.completions.create(model="demo-model", messages=MSG, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        stack.openai().chat.completions.create(model="no-such-model-7", messages=MSG)
    with pytest.raises(openai.AuthenticationError):
        stack.openai(api_key="md-wrong-key").models.list()
    expected = {("proxied", "", "acme", "demo-model"): 1, ("rejected", "404", "acme", ""): 1,
                ("rejected", "401", "", ""): 1}

    def grown() -> dict[tuple[str, str, str, str], float]:
        now = requests_counted(stack)
        return {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}

    try:
        wait_until(lambda: grown() == expected, 5)
    except AssertionError:
        raise AssertionError(f"counted {grown()}, expected {expected}") from None
    assert all(model in ("", "demo-model", "other-model") for _, _, _, model in requests_counted(stack))


def test_a_client_chosen_destination_header_is_not_honoured(stack: Stack) -> None:
    decoy = stack.sims[2]
    before = len(decoy.requests())
    client = stack.openai(default_headers={"x-gateway-destination-endpoint": decoy.address,
                                           "x-gateway-destination-endpoint-subset": decoy.address})
    for _ in range(6):
        reply = client.chat.completions.create(model="demo-model", messages=MSG, max_tokens=3)
        assert reply.choices[0].message.content
    assert len(decoy.requests()) == before, "a request went where the client said"


def test_a_client_disconnect_cancels_upstream_and_releases_the_count(stack: Stack) -> None:
    if stack.mesh.endswith("-buffered"):  # type: ignore[attr-defined]
        pytest.skip("a buffered response reaches the client only when it has ended")
    before = [s.stats()["cancelled"] for s in stack.sims]
    stack.leave_mid_stream(MSG, max_tokens=2000)
    wait_until(lambda: any(s.stats()["cancelled"] > b for s, b in zip(stack.sims, before, strict=True)), 5,
               what="the backend saw the cancellation")
    wait_until(lambda: stack.in_flight() == 0, 5, what="in-flight count released")


def test_a_body_over_the_limit_is_a_413_json(stack: Stack) -> None:
    # Small enough to be written whole before the gateway answers (and under Envoy's own 1 MiB buffer).
    reply = raw_request("POST", f"{stack.base_url}/chat/completions", b"x" * (100 * 1024),
                        [("authorization", f"Bearer {API_KEY}"), ("content-type", "application/json")])
    assert reply.status == 413 and reply.json()["error"]["code"] == "request_too_large"


def test_a_failing_endpoint_before_headers(stack: Stack) -> None:
    """Istio retries onto the fallback the picker ranked (its default policy retries a 503) and reports
    where it was served, which moves the count; Envoy AI Gateway has one endpoint per request, so a
    request picked onto a server that resets before headers fails with Envoy's own plain-text 503."""
    failing, healthy = stack.sims[1], stack.sims[0]
    istio = stack.mesh == "istio"  # type: ignore[attr-defined]
    failing.fault("status_503" if istio else "reset_before_headers", count=1000)
    retries = stack.metric("modeldock_retries_seen_total")
    before = len(failing.requests())
    replies = []
    try:
        for _ in range(10):  # the picker alternates between two idle endpoints: both get picked
            replies.append(raw_request(
                "POST", f"{stack.base_url}/chat/completions",
                b'{"model":"demo-model","messages":[{"role":"user","content":"hi"}],"max_tokens":2}',
                [("authorization", f"Bearer {API_KEY}"), ("content-type", "application/json")], timeout=20))
    finally:
        failing.fault("none")
    assert len(failing.requests()) > before, "the failing endpoint was picked"
    statuses = [r.status for r in replies]
    if istio:
        assert statuses == [200] * 10
        assert stack.metric("modeldock_retries_seen_total") > retries, "the served report moved the count"
        assert healthy.requests()
    else:
        assert set(statuses) == {200, 503}, statuses
        failed = next(r for r in replies if r.status == 503)
        assert not failed.headers.get("content-type", "").startswith("application/json")  # Envoy's, not JSON
    wait_until(lambda: stack.in_flight() == 0, 5, what="in-flight count released")


def usage_records(stack: Stack) -> list[dict[str, Any]]:
    path = stack.run_dir / "usage.picker.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_stream_is_settled_with_the_usage_the_picker_read_and_only_a_client_that_asked_sees_it(
        stack: Stack) -> None:
    for asked in (False, True):
        before = len(usage_records(stack))
        usages = []
        for chunk in stack.openai().chat.completions.create(
                model="demo-model", messages=MSG, max_tokens=8, stream=True,
                **({"stream_options": {"include_usage": True}} if asked else {})):
            if chunk.usage is not None:
                usages.append(chunk.usage)
        wait_until(lambda before=before: len(usage_records(stack)) > before, 5, what="the usage record")  # type: ignore[misc]
        record = usage_records(stack)[-1]
        assert record["token_source"] == "reported" and record["completion_tokens"] > 0, record
        if asked:
            [usage] = usages
            assert (usage.prompt_tokens, usage.completion_tokens) == (record["prompt_tokens"],
                                                                      record["completion_tokens"])
        else:
            assert usages == []  # the usage event the gateway asked for was dropped
