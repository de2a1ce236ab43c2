"""Hardening of the request flow, end to end: the openai SDK through real Envoy, ext_proc, xDS and simulators."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from tests.support.stack import API_KEY, Sim, Stack, raw_request, running_stack, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("hardening")) as s:
        yield s


@pytest.fixture(autouse=True)
def no_leaked_in_flight(stack: Stack) -> Iterator[None]:
    yield
    wait_until(lambda: stack.in_flight() == 0, 5, what="in-flight count back to 0")


def _not_found(stack: Stack, model: str) -> dict[str, object]:
    with pytest.raises(openai.NotFoundError) as info:
        stack.openai().chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                               extra_headers={"x-request-id": f"probe-{model}"})
    assert info.value.status_code == 404
    body: dict[str, object] = info.value.body
    return body


def test_unknown_and_forbidden_models_are_one_answer(stack: Stack) -> None:
    unknown, forbidden = _not_found(stack, "no-such-model"), _not_found(stack, "other-model")
    assert unknown["code"] == forbidden["code"] == "model_not_found"
    assert unknown["message"] == "The model `no-such-model` does not exist or you do not have access to it."
    assert forbidden["message"] == "The model `other-model` does not exist or you do not have access to it."
    assert unknown["type"] == forbidden["type"] and unknown["param"] == forbidden["param"] is None
    # The log keeps the real reason, under the request id.
    log = (stack.run_dir / "extproc.log").read_text()
    assert any("probe-no-such-model" in line and "unknown model" in line for line in log.splitlines())
    assert any("probe-other-model" in line and "allowlist" in line for line in log.splitlines())


def test_a_body_with_two_models_is_refused_before_any_backend(stack: Stack) -> None:
    before = [len(sim.requests()) for sim in stack.sims]
    r = raw_request("POST", f"{stack.base_url}/chat/completions",
                    b'{"model": "other-model", "model": "demo-model", "messages": []}',
                    [("authorization", f"Bearer {API_KEY}"), ("content-type", "application/json")])
    assert r.status == 400
    error = r.json()["error"]
    assert error["code"] == "duplicate_key" and "`model`" in error["message"]
    assert [len(sim.requests()) for sim in stack.sims] == before
    # The same request with one model goes through.
    reply = stack.openai().chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "x"}],
                                                   max_tokens=2)
    assert reply.choices[0].message.content


def picker_in_flight(stack: Stack) -> dict[str, float]:
    """modeldock_picker_in_flight by endpoint (summed over the models that share it), from ext_proc's metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.extproc_metrics_port}/metrics",  # noqa: S310
                                  timeout=2).read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("modeldock_picker_in_flight{"):
            labels, value = line.rsplit(" ", 1)
            endpoint = labels.split('endpoint="', 1)[1].split('"', 1)[0]
            found[endpoint] = found.get(endpoint, 0.0) + float(value)
    return found


def _slow(sim: Sim, ms: float) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{sim.url}/sim/slow", method="POST",  # noqa: S310
                                                  data=json.dumps({"extra_step_ms": ms}).encode()), timeout=2).read()


def test_requests_sharing_a_client_request_id_are_counted_apart(stack: Stack) -> None:
    """The client chooses x-request-id; ext_proc keys its accounting on its own modeldock:rid. Streams that
    share an id, the ones routed to a backend answering 503 retried onto the other, are each counted where they
    run, and every count returns to 0."""
    failing, healthy = stack.sims
    retried_before = stack.metric("modeldock_retries_seen_total")
    streams = []
    try:
        failing.fault("status_503")
        for sim in stack.sims:
            _slow(sim, 20)  # long streams: they stay open while the counts are read
        client = stack.openai()
        for n in range(1, 4):
            stream = client.chat.completions.create(
                model="demo-model", messages=[{"role": "user", "content": "x"}], max_tokens=500, stream=True,
                extra_headers={"x-request-id": "shared-id"})
            streams.append(stream)
            next(iter(stream))  # served: the first chunk is in
            # An endpoint that gave back its count (the failing one) is the picker's first choice next time,
            # so the later streams are retried; every count follows its own stream.
            wait_until(lambda n=n: picker_in_flight(stack) == {failing.address: 0, healthy.address: n}, 5,
                       what=f"{n} streams counted on the healthy endpoint")
        assert stack.metric("modeldock_retries_seen_total") > retried_before, "no stream was retried"
        assert healthy.stats()["running"] == 3
        streams.pop(0).close()
        wait_until(lambda: picker_in_flight(stack) == {failing.address: 0, healthy.address: 2}, 5,
                   what="the first stream's end releases its own count only")
    finally:
        for stream in streams:
            stream.close()
        failing.fault("none")
        for sim in stack.sims:
            _slow(sim, 0)
    wait_until(lambda: set(picker_in_flight(stack).values()) == {0}, 5, what="every count back to 0")
    # Envoy's access log names the tenant (modeldock:tenant) and keeps the client's id for correlation.
    envoy_log = stack.run_dir / "envoy.log"
    wait_until(lambda: envoy_log.read_text(errors="replace").count("id=shared-id") >= 3, 5, what="access log lines")
    lines = [line for line in envoy_log.read_text(errors="replace").splitlines() if "id=shared-id" in line]
    assert all(" tenant=acme " in line for line in lines), lines
