"""A property, end to end through real Envoy in both modes (modeldock's own bootstrap and picker mode behind
Istio's Envoy config): for random bodies and random points where the client leaves, what the request is
charged is at least what the simulator produced for it. The simulators parse fields as vLLM does."""

from __future__ import annotations

import http.client
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modeldock.config import hash_key
from modeldock.usage.record import UsageRecord
from tests.support.stack import Sim, Stack, running_stack, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

KEY = f"md-prop-{secrets.token_hex(4)}"
RESERVE = 48  # limits.reserve_completion_tokens


def _records(usage_dir: Path) -> list[UsageRecord]:
    found = []
    for path in sorted(usage_dir.glob("usage*.jsonl")):
        found += [UsageRecord.from_json(line) for line in path.read_text().splitlines() if line.strip()]
    return found


@pytest.fixture(scope="module", params=[None, "istio"], ids=["bootstrap", "picker"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    usage_dir = tmp_path_factory.mktemp("usage")

    def edit(data: dict[str, Any], sims: list[Sim]) -> None:
        data["tenants"].append({"id": "prop", "api_key_hashes": [hash_key(KEY)], "models": ["demo-*"],
                                "tokens_per_minute": 10_000_000})
        if request.param is not None:  # picker mode: the pool is the first two simulators
            data["models"][1]["endpoints"] = [sims[-1].address]
            data["models"][0]["endpoints"] = [s.address for s in sims[:2]]
        data["limits"] = {"reserve_completion_tokens": RESERVE, "max_body_bytes": 64 * 1024}
        data["usage"] = {"path": str(usage_dir / "usage.jsonl"), "fsync_interval_seconds": 0}

    backends = 3 if request.param else 2
    with running_stack(tmp_path_factory.mktemp("prop"), backends=backends, mesh=request.param, edit_config=edit,
                       sim_args=("--speed", "4", "--default-max-tokens", "2000")) as stack:
        yield stack, usage_dir


def _limit_value(n: int, form: str) -> Any:
    return {"int": n, "float": float(n), "str": str(n), "padded": f" {n} "}[form]


bodies = st.fixed_dictionaries({
    "kind": st.sampled_from(["chat", "completion"]),
    "stream": st.booleans(),
    "usage": st.booleans(),
    "limit": st.one_of(st.none(), st.integers(1, 120)),
    "form": st.sampled_from(["int", "float", "str", "padded"]),
    "n": st.integers(1, 3),
    "prompts": st.integers(1, 3),
    # Where the client leaves: never, after this many body bytes, or before the response (a short timeout).
    "leave": st.one_of(st.none(), st.integers(1, 600), st.just(-1)),
})


def record_sequences(case: dict[str, Any]) -> int:
    """Engine sequences the request makes: one per (prompt, sample)."""
    return case["n"] * (case["prompts"] if case["kind"] == "completion" else 1)


def _body(case: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": "demo-model", "n": case["n"]}
    if case["kind"] == "chat":
        path = "chat/completions"
        body["messages"] = [{"role": "user", "content": "count slowly " * 3}]
    else:
        path = "completions"
        body["prompt"] = ["count slowly"] * case["prompts"] if case["prompts"] > 1 else "count slowly"
    if case["limit"] is not None:
        body["max_tokens"] = _limit_value(case["limit"], case["form"])
    if case["stream"]:
        body["stream"] = True
        if case["usage"]:
            body["stream_options"] = {"include_usage": True}
    return path, body


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=bodies)
def test_the_charge_is_at_least_what_the_backend_produced(env: tuple[Stack, Path], case: dict[str, Any]) -> None:
    stack, usage_dir = env
    sims = stack.sims
    wait_until(lambda: all(s.stats()["running"] == 0 for s in sims), 15, what="backends idle")
    before = [s.token_counters() for s in sims]
    client_id = f"prop-{secrets.token_hex(6)}"
    path, body = _body(case)
    data = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=0.15 if case["leave"] == -1 else 30.0)
    try:
        conn.request("POST", f"/v1/{path}", data, {"authorization": f"Bearer {KEY}", "x-request-id": client_id,
                                                    "content-type": "application/json"})
        reply = conn.getresponse()
        if case["leave"] is None:
            reply.read()
        elif case["leave"] > 0:
            reply.read(case["leave"])  # the client leaves mid-response
    except TimeoutError:
        pass  # left before the response
    finally:
        conn.close()
    found: list[UsageRecord] = []

    def recorded() -> bool:
        found[:] = [r for r in _records(usage_dir) if r.client_request_id == client_id]
        return bool(found)

    wait_until(recorded, 10, what="the request's usage record")
    wait_until(lambda: all(s.stats()["running"] == 0 for s in sims), 15, what="backends idle")
    after = [s.token_counters() for s in sims]
    prompt = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    produced = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    (record,) = found
    assert record.completion_tokens >= produced, (case, record, produced)
    # The prompt is billed once per request (as the backend's usage counts it), though each of n sequences
    # prefills it: a request that reached the backend is charged at least one sequence's prompt.
    if prompt:
        assert record.prompt_tokens > 0 and record.prompt_tokens * record_sequences(case) >= prompt, (case, record)
