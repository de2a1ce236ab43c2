"""The gateway as a user sees it: the openai SDK through real Envoy, ext_proc, xDS and simulators."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.stack import API_KEY, OTHER_KEY, Stack, raw_request, running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_leaked_in_flight")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Real-time simulators: 20 ms per step makes streaming visible.
    with running_stack(tmp_path_factory.mktemp("gw"), sim_args=("--step-base-ms", "20", "--speed", "1")) as s:
        yield s


def test_chat_completion_non_streaming(stack: Stack) -> None:
    reply = stack.openai().chat.completions.create(
        model="demo-model", messages=[{"role": "user", "content": "Hello"}], max_tokens=5
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    assert reply.model == "demo-model"


def test_completion_non_streaming(stack: Stack) -> None:
    reply = stack.openai().completions.create(model="demo-model", prompt="Once upon a time", max_tokens=4)
    assert reply.choices[0].text
    assert reply.usage is not None and reply.usage.completion_tokens == 4


def test_streaming_chunks_arrive_while_generating(stack: Stack) -> None:
    started = time.perf_counter()
    arrivals: list[float] = []
    text = ""
    usage = None
    stream = stack.openai().chat.completions.create(
        model="demo-model", messages=[{"role": "user", "content": "Count"}], max_tokens=20, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter() - started)
            text += chunk.choices[0].delta.content
    assert len(arrivals) == 20 and text
    assert usage is not None and usage.completion_tokens == 20
    # 20 steps of >= 20 ms each: if Envoy or ext_proc buffered the stream, every
    # chunk would land at once at the end.
    spread = arrivals[-1] - arrivals[0]
    assert spread > 0.2, f"chunks arrived within {spread * 1000:.0f} ms: buffered, not streamed"
    assert len({round(t, 3) for t in arrivals}) > 10


def test_streaming_completions(stack: Stack) -> None:
    pieces = [c.choices[0].text for c in stack.openai().completions.create(
        model="demo-model", prompt="a b c", max_tokens=3, stream=True) if c.choices]
    assert len([p for p in pieces if p]) == 3


def test_models_lists_the_tenants_models(stack: Stack) -> None:
    assert [m.id for m in stack.openai().models.list()] == ["demo-model"]
    assert [m.id for m in stack.openai(api_key=OTHER_KEY).models.list()] == ["other-model"]


@pytest.mark.parametrize("key", ["wrong-key", ""])
def test_bad_key_is_401_authentication_error(stack: Stack, key: str) -> None:
    client = stack.openai(api_key=key or "placeholder")
    headers = {"Authorization": ""} if not key else {}
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "x"}],
                                       extra_headers=headers)
    assert info.value.status_code == 401
    assert info.value.body["code"] in ("invalid_api_key", "missing_api_key")
    assert info.value.body["message"]


def test_model_outside_allowlist_is_404_like_an_unknown_one(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        stack.openai().chat.completions.create(model="other-model", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"


def test_unknown_model_is_404(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        stack.openai().chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(("content", "code"), [
    (b"{not json", "invalid_json"),
    (b'{"messages": []}', "missing_model"),
    (b"", "invalid_body"),
])
def test_bad_body_is_400_json_error(stack: Stack, content: bytes, code: str) -> None:
    r = raw_request("POST", f"{stack.base_url}/chat/completions", content,
                    [("Authorization", f"Bearer {API_KEY}"), ("content-type", "application/json")])
    assert r.status == 400
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == code


def test_openai_sdk_raises_bad_request_for_missing_model(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError):
        stack.openai().chat.completions.create(model="", messages=[{"role": "user", "content": "x"}])


def test_client_cannot_choose_endpoint_and_backend_never_sees_key(stack: Stack, tmp_path: Path) -> None:
    a, b = stack.sims
    before = {s.port: len(s.requests()) for s in stack.sims}
    client = stack.openai()
    for _ in range(10):
        client.chat.completions.create(
            model="demo-model", messages=[{"role": "user", "content": "x"}], max_tokens=1,
            extra_headers={"x-gateway-destination-endpoint": b.address, "x-modeldock-cluster": "model:other-model"},
        )
    seen = []
    for sim in stack.sims:
        for req in sim.requests()[before[sim.port]:]:
            names = {k.lower(): v for k, v in req["headers"]}
            assert "authorization" not in names, "the backend saw the client's Authorization"
            assert API_KEY not in repr(req)
            assert "x-modeldock-cluster" not in names
            # The client's routing headers are dropped; Envoy routes on ext_proc's metadata.
            assert "x-gateway-destination-endpoint" not in names
            seen.append(sim.port)
    assert len(seen) == 10
    assert a.port in seen, "every request went where the client asked"


def test_access_log_and_backend_logs_hold_no_key(stack: Stack) -> None:
    stack.openai().chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "x"}],
                                           max_tokens=1)
    for log in stack.run_dir.glob("*.log"):
        assert API_KEY not in log.read_text(errors="replace"), f"{log.name} contains the API key"
