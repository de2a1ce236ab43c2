"""Billing holes a hostile tenant could use, each closed and pinned through real Envoy, ext_proc, Redis-free
local budgets and the simulators (which parse request fields as vLLM does), with the openai SDK as client.

The rule under test (admission/README.md "The settlement rule"): whatever a request can be charged without a
usage report is at least what the backend can have produced for it, because the body it carries upstream is
bounded by what was reserved.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from modeldock.config import hash_key
from modeldock.usage.record import UsageRecord
from tests.support.stack import Sim, Stack, raw_request, running_stack, wait_until
from tests.support.usage_records import read_usage_records, wait_for_usage_record

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

_RUN = secrets.token_hex(4)
LENIENT = [
    ("chat", {"max_tokens": 5000.0}),
    ("chat", {"max_tokens": "5000"}),
    ("chat", {"max_completion_tokens": " 5000 "}),
    ("chat", {"n": 250, "max_tokens": 20}),
    ("completion", {"prompt": ["count to ten"] * 50, "max_tokens": 100}),
]
SMALL_TENANTS = [f"small{i}" for i in range(len(LENIENT))]  # one each: every case starts with a whole budget
KEYS = {t: f"md-bill-{t}-{_RUN}" for t in ("big", "slow", "cap", *SMALL_TENANTS)}
RESERVE = 64  # limits.reserve_completion_tokens
SMALL = 2000  # the small tenant's tokens_per_minute
MSG = [{"role": "user", "content": "tell me a long story"}]


@dataclass
class Env:
    stack: Stack
    usage_dir: Path

    def client(self, tenant: str, **kwargs: Any) -> openai.OpenAI:
        return self.stack.openai(KEYS[tenant], **kwargs)

    def records(self) -> list[UsageRecord]:
        return read_usage_records(self.usage_dir)

    def record(self, client_id: str) -> UsageRecord:
        return wait_for_usage_record(self.records, client_id)

    def generated(self) -> int:
        return sum(sim.token_counters()[1] for sim in self.stack.sims)

    def forwarded(self, client_id: str) -> dict[str, Any]:
        """The body a backend received for the request (the simulators log every request)."""
        for sim in self.stack.sims:
            for entry in sim.requests():
                if any(k.lower() == "x-request-id" and v == client_id for k, v in entry["headers"]):
                    body: dict[str, Any] = entry["body"]
                    return body
        raise AssertionError(f"no backend received {client_id}")

    def idle(self) -> None:
        wait_until(lambda: all(s.stats()["running"] == 0 for s in self.stack.sims), 15, what="backends idle")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    usage_dir = tmp_path_factory.mktemp("usage")

    def edit(data: dict[str, Any], _sims: list[Sim]) -> None:
        def tenant(tid: str, **limits: Any) -> dict[str, Any]:
            return {"id": tid, "api_key_hashes": [hash_key(KEYS[tid])], "models": ["demo-*"], **limits}

        data["tenants"] += [tenant("big", tokens_per_minute=10_000_000), tenant("slow", tokens_per_minute=10_000_000),
                            tenant("cap", tokens_per_minute=SMALL),
                            *(tenant(t, tokens_per_minute=SMALL) for t in SMALL_TENANTS)]
        data["limits"] = {"reserve_completion_tokens": RESERVE}
        data["usage"] = {"path": str(usage_dir / "usage.jsonl"), "fsync_interval_seconds": 0}

    # A backend that, unbounded, generates 3000 tokens (what a request without max_tokens would get), at
    # 3 ms a step: 400 tokens take over a second.
    with running_stack(tmp_path_factory.mktemp("billing"), edit_config=edit,
                       sim_args=("--speed", "2", "--default-max-tokens", "3000")) as stack:
        yield Env(stack, usage_dir)


def rid(name: str) -> str:
    return f"{name}-{secrets.token_hex(4)}"


def test_a_stream_without_max_tokens_is_bounded_by_its_reservation_even_when_the_client_leaves(env: Env) -> None:
    env.idle()
    before = env.generated()
    client_id = rid("nolimit")
    raw = env.client("big").chat.completions.with_raw_response.create(
        model="demo-model", messages=MSG, stream=True, extra_headers={"x-request-id": client_id})
    assert raw.headers["x-modeldock-output-limit"] == str(RESERVE)
    assert raw.headers["x-modeldock-output-limit-reason"] == "default"
    stream = raw.parse()
    content = 0
    for chunk in stream:  # leave before the usage chunk: read the content, close before the end
        if chunk.choices and chunk.choices[0].delta.content:
            content += 1
            if content == RESERVE - 4:
                break
    stream.close()
    assert env.forwarded(client_id)["max_tokens"] == RESERVE
    record = env.record(client_id)
    env.idle()
    produced = env.generated() - before
    assert 0 < produced <= RESERVE  # the backend was bounded by what was reserved
    assert record.completion_tokens >= produced and record.termination == "client_disconnect"


def test_a_client_limit_above_the_remaining_budget_is_lowered_and_said_so(env: Env) -> None:
    client_id = rid("cap")
    raw = env.client("cap").chat.completions.with_raw_response.create(
        model="demo-model", messages=MSG, max_tokens=5000, extra_headers={"x-request-id": client_id})
    reply = raw.parse()
    limit = int(raw.headers["x-modeldock-output-limit"])
    assert raw.headers["x-modeldock-output-limit-reason"] == "budget"
    assert limit < SMALL and env.forwarded(client_id)["max_tokens"] == limit
    assert reply.usage is not None and reply.usage.completion_tokens <= limit
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize("field,value", [("stream", "true"), ("stream", 1), ("stream_options", {"include_usage": "1"})])
def test_a_stream_flag_that_is_not_a_json_boolean_is_refused(env: Env, field: str, value: Any) -> None:
    body = {"model": "demo-model", "messages": MSG, "max_tokens": 5, field: value}
    if field == "stream_options":
        body["stream"] = True
    reply = raw_request("POST", f"{env.stack.base_url}/chat/completions", json.dumps(body).encode(),
                        [("authorization", f"Bearer {KEYS['big']}"), ("content-type", "application/json")])
    assert reply.status == 400
    error = reply.json()["error"]
    assert error["code"] == "invalid_value" and error["param"].startswith(field)


@pytest.mark.parametrize("case", range(len(LENIENT)), ids=[json.dumps(f)[:40] for _, f in LENIENT])
def test_forms_the_backend_accepts_are_counted_as_it_counts_them(env: Env, case: int) -> None:
    """Each asks for about 5,000 output tokens of a tenant with 2,000 a minute. Admitted or not, what it is
    charged bounds what the backend produced, and no request takes the tenant over its budget."""
    kind, fields = LENIENT[case]
    env.idle()
    before = env.generated()
    client_id = rid("lenient")
    body: dict[str, Any] = {"model": "demo-model", **fields}
    if kind == "chat":
        body["messages"] = MSG
    path = "chat/completions" if kind == "chat" else "completions"
    reply = raw_request("POST", f"{env.stack.base_url}/{path}", json.dumps(body).encode(),
                        [("authorization", f"Bearer {KEYS[SMALL_TENANTS[case]]}"), ("x-request-id", client_id),
                         ("content-type", "application/json")], timeout=30)
    env.idle()
    produced = env.generated() - before
    if reply.status == 429:
        assert produced == 0
        return
    assert reply.status == 200, reply.body
    forwarded = env.forwarded(client_id)
    limit_field = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    per_choice = forwarded[limit_field]
    assert type(per_choice) is int  # the backend gets the integer the gateway counted
    choices = len(reply.json()["choices"])
    assert choices == fields.get("n", 1) * (len(fields["prompt"]) if "prompt" in fields else 1)
    assert produced <= per_choice * choices
    record = env.record(client_id)
    assert record.prompt_tokens + record.completion_tokens <= SMALL
    assert record.completion_tokens >= produced


def test_a_client_that_leaves_before_the_response_headers_is_charged(env: Env) -> None:
    """vLLM sends a non-streaming response's headers after generating: leaving before them is not free."""
    env.idle()
    before = env.generated()
    client_id = rid("slow")
    client = env.client("slow", timeout=0.6)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="demo-model", messages=MSG, max_tokens=400,
                                       extra_headers={"x-request-id": client_id})
    record = env.record(client_id)
    env.idle()
    produced = env.generated() - before
    assert produced > 0
    assert record.completion_tokens >= produced and record.completion_tokens == 400
    assert record.prompt_tokens > 0 and record.termination == "client_disconnect"
