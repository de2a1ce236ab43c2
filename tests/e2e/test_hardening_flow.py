"""Hardening of the request flow, end to end: the openai SDK through real Envoy, ext_proc, xDS and simulators."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support.stack import API_KEY, Stack, raw_request, running_stack, wait_until

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
