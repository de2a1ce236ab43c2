"""Hardening of the request flow, end to end: the openai SDK through real Envoy, ext_proc, xDS and simulators."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.stack import API_KEY, OTHER_KEY, Sim, Stack, raw_request, running_stack, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_leaked_in_flight")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("hardening")) as s:
        yield s


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


BACKEND_KEY = "sk-backend-9f3e1c7a55"
ROTATED_KEY = "sk-rotated-4b2d8e6f11"


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    """Backends started like `vllm serve --api-key`; demo-model names its credential file."""
    secrets = tmp_path_factory.mktemp("secrets")  # outside the stack's run dir, whose files are grepped
    key_file = secrets / "vllm-key"
    key_file.write_text(BACKEND_KEY + "\n")

    def edit(data: dict[str, Any], _sims: object) -> None:
        data["models"][0]["upstream_auth"] = {"file": str(key_file)}

    with running_stack(tmp_path_factory.mktemp("locked"), sim_args=("--speed", "20", "--api-key", BACKEND_KEY),
                       edit_config=edit) as s:
        yield s, key_file


def _sent_authorization(stack: Stack) -> list[str | None]:
    """The Authorization header each backend received, latest last (backends log refused requests too)."""
    entries = sorted((e for sim in stack.sims for e in sim.requests()), key=lambda e: e["time"])
    return [dict((k.lower(), v) for k, v in e["headers"]).get("authorization") for e in entries]


def test_the_backend_gets_the_models_credential_and_a_rotation_needs_no_restart(locked: tuple[Stack, Path]) -> None:
    stack, key_file = locked
    client = stack.openai()
    reply = client.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert reply.parse().choices[0].message.content  # the backends refuse anything but their key
    assert _sent_authorization(stack)[-1] == f"Bearer {BACKEND_KEY}"  # not the client's key
    assert BACKEND_KEY not in json.dumps(dict(reply.headers)) and API_KEY not in json.dumps(dict(reply.headers))
    stream = client.chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=3, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    # A model without upstream_auth sends nothing: the backend answers 401, passed on as it wrote it.
    with pytest.raises(openai.AuthenticationError):
        stack.openai(api_key=OTHER_KEY).chat.completions.create(
            model="other-model", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert _sent_authorization(stack)[-1] is None
    # Rotating the file: the next requests carry the new key, with no restart (the backends still want the
    # old one, so they refuse it); rotating back restores service.
    key_file.write_text(ROTATED_KEY + "\n")

    def sends(key: str) -> bool:
        try:
            client.chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "x"}],
                                           max_tokens=2)
        except openai.AuthenticationError:
            pass
        return _sent_authorization(stack)[-1] == f"Bearer {key}"

    wait_until(lambda: sends(ROTATED_KEY), 10, interval=0.2, what="the rotated key upstream")
    key_file.write_text(BACKEND_KEY + "\n")
    wait_until(lambda: sends(BACKEND_KEY), 10, interval=0.2, what="the original key upstream")
    assert client.chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=2).choices[0].message.content
    # No log of the stack (ext_proc at debug level, xDS, Envoy's access log, the backends) shows either key.
    wait_until(lambda: stack.in_flight() == 0, 5, what="in-flight count back to 0")
    for log in stack.run_dir.iterdir():
        if log.is_file():
            text = log.read_text(errors="replace")
            assert BACKEND_KEY not in text and ROTATED_KEY not in text, log.name
