"""A near-miss key through real Envoy: the tenant's stored hash equals the key's real hash except for
its last hex character. Every route that authenticates must answer 401 with an OpenAI-style JSON
error, and no backend may see the request. A gateway comparing only part of the digest would let
this key in, so the same requests are first shown to succeed with the real key.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from modeldock.config import hash_key
from tests.support.stack import Stack, raw_request, running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("no_leaked_in_flight")]

_RUN = secrets.token_hex(6)
NEAR_KEY = f"md-near-miss-{_RUN}"  # stored under a hash one hex character off
GOOD_KEY = f"md-near-good-{_RUN}"  # stored exactly, same models: the control
MSG = [{"role": "user", "content": "hi"}]


def near_miss_hash(key: str) -> str:
    real = hash_key(key)
    last = real[-1]
    return real[:-1] + ("0" if last != "0" else "1")


def _edit(data: dict[str, Any], sims: Any) -> None:
    data["tenants"] += [
        {"id": "nearmiss", "api_key_hashes": [near_miss_hash(NEAR_KEY)], "models": ["demo-*"]},
        {"id": "control", "api_key_hashes": [hash_key(GOOD_KEY)], "models": ["demo-*"]},
    ]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("nearmiss"), edit_config=_edit) as s:
        yield s


def received(stack: Stack) -> int:
    return sum(s.stats()["received"] for s in stack.sims)


CALLS: dict[str, Callable[[openai.OpenAI], Any]] = {
    "chat": lambda c: c.chat.completions.create(model="demo-model", messages=MSG, max_tokens=2),
    "chat-stream": lambda c: list(c.chat.completions.create(model="demo-model", messages=MSG, max_tokens=2,
                                                            stream=True)),
    "completions": lambda c: c.completions.create(model="demo-model", prompt="hi", max_tokens=2),
    "models": lambda c: [m.id for m in c.models.list()],
}


def test_the_hashes_differ_only_in_the_last_character() -> None:
    real, stored = hash_key(NEAR_KEY), near_miss_hash(NEAR_KEY)
    assert real != stored and real[:-1] == stored[:-1]


@pytest.mark.parametrize("call", list(CALLS))
def test_near_miss_key_is_401_on_every_authenticating_route(stack: Stack, call: str) -> None:
    # The control key, stored exactly, gets through on the same route.
    assert CALLS[call](stack.openai(api_key=GOOD_KEY))
    before = received(stack)
    with pytest.raises(openai.AuthenticationError) as info:
        CALLS[call](stack.openai(api_key=NEAR_KEY))
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"
    assert info.value.body["type"] == "invalid_request_error"
    assert info.value.body["message"] and NEAR_KEY not in info.value.body["message"]
    assert received(stack) == before, "a backend received the request of a rejected key"


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/chat/completions", b'{"model": "demo-model", "messages": [{"role": "user", "content": "hi"}]}'),
    ("POST", "/completions", b'{"model": "demo-model", "prompt": "hi"}'),
    ("GET", "/models", None),
])
def test_near_miss_key_gets_the_json_error_shape(stack: Stack, method: str, path: str, body: bytes | None) -> None:
    headers = [("Authorization", f"Bearer {NEAR_KEY}"), ("content-type", "application/json")]
    good = raw_request(method, stack.base_url + path, body, [("Authorization", f"Bearer {GOOD_KEY}"), headers[1]])
    assert good.status == 200, good.body[:300]
    r = raw_request(method, stack.base_url + path, body, headers)
    assert r.status == 401, r.body[:300]
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_api_key"
    assert NEAR_KEY.encode() not in r.body
