"""Token budgets and usage settlement through real Envoy, two ext_proc replicas, a real Redis and the
simulators, with the openai SDK as the client.

What is charged is read from Redis itself (the shared window's running total per tenant), what was
used from the backends' own counters and the usage records ext_proc writes.
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
import yaml

from modeldock.budgets.redis_window import budget_key
from modeldock.config import hash_key
from modeldock.usage.record import UsageRecord
from tests.support.redis_server import RedisServer
from tests.support.stack import API_KEY, Sim, Stack, running_stack, wait_until
from tests.support.usage_records import read_usage_records, wait_for_usage_record

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

MSG = [{"role": "user", "content": "hello there"}]
_RUN = secrets.token_hex(4)
TENANTS = ("shared", "json", "retry", "cancel", "redis", "hdr")
KEYS = {t: f"md-tok-{t}-{_RUN}" for t in TENANTS}
SHARED_BUDGET = 1500
BIG = 10_000_000
LEASE_MS = 1000  # limits.token_lease_ms: a replica admits from a block reserved in Redis for this long


@dataclass
class Env:
    stack: Stack
    redis: RedisServer
    usage_dir: Path
    base: dict[str, Any]

    def client(self, tenant: str | None = None) -> openai.OpenAI:
        return self.stack.openai(KEYS[tenant] if tenant else API_KEY)

    def charged(self, tenant: str) -> int:
        """Tokens in the tenant's shared minute window (the Redis running total)."""
        client = redis.Redis.from_url(self.redis.url)
        try:
            value = client.hget(budget_key(tenant, "minute") + ":amt", "~total")
        finally:
            client.close()
        return int(value or 0)

    def records(self) -> list[UsageRecord]:
        return read_usage_records(self.usage_dir, "usage.*.jsonl")

    def record(self, client_id: str) -> UsageRecord:
        return wait_for_usage_record(self.records, client_id)

    def settled(self) -> bool:
        """Every replica's pending settlements table is empty and nothing is in flight."""
        return self.stack.in_flight() == 0 and sum(self.stack.metric_per_replica(
            "modeldock_usage_pending_settlements")) == 0


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    usage_dir = tmp_path_factory.mktemp("usage")
    captured: dict[str, Any] = {}

    def edit(data: dict[str, Any], _sims: Any) -> None:
        def tenant(tid: str, **limits: Any) -> dict[str, Any]:
            return {"id": tid, "api_key_hashes": [hash_key(KEYS[tid])], "models": ["demo-*"], **limits}

        data["tenants"] += [tenant("shared", tokens_per_minute=SHARED_BUDGET),
                            *(tenant(t, tokens_per_minute=BIG) for t in ("json", "retry", "cancel", "redis")),
                            tenant("hdr", tokens_per_minute=BIG, tokens_per_day=BIG)]
        data["limits"] = {"redis_timeout_ms": 2000, "token_lease_ms": LEASE_MS}
        data["usage"] = {"path": str(usage_dir / "usage.jsonl"), "fsync_interval_seconds": 0}
        captured.update(copy.deepcopy(data))

    server = RedisServer()
    server.start()
    try:
        with running_stack(tmp_path_factory.mktemp("budgets"), edit_config=edit, extproc_replicas=2,
                           sim_args=("--step-base-ms", "5", "--speed", "1"),
                           extproc_env={"REDIS_URL": server.url}) as stack:
            yield Env(stack, server, usage_dir, captured)
    finally:
        server.close()


@pytest.fixture(autouse=True)
def settled_after(env: Env) -> Iterator[None]:
    yield
    if not env.redis.running:
        env.redis.start()
    for sim in env.stack.sims:
        sim.fault("none")
    # Nothing left behind: no request in flight, no settlement pending, on either replica.
    wait_until(env.settled, 15, what="in-flight and pending settlements back to 0 on every replica")


def rid(name: str) -> str:
    return f"{name}-{secrets.token_hex(4)}"


def sim_tokens(sims: list[Sim]) -> tuple[int, int]:
    """(prompt, generation) tokens the simulators counted, from their own /metrics."""
    counts = [sim.token_counters() for sim in sims]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def test_a_non_streaming_request_is_charged_its_reported_usage_and_carries_token_headers(env: Env) -> None:
    client_id = rid("json")
    raw = env.client("json").chat.completions.with_raw_response.create(
        model="demo-model", messages=MSG, max_tokens=7, extra_headers={"x-request-id": client_id})
    reply = raw.parse()
    assert reply.usage is not None
    reserved = BIG - int(raw.headers["x-ratelimit-remaining-tokens"])
    assert raw.headers["x-ratelimit-limit-tokens"] == str(BIG)
    assert raw.headers["x-ratelimit-reset-tokens"]
    assert reserved > reply.usage.total_tokens  # the reservation was the ceiling; the charge is the usage
    wait_until(lambda: env.charged("json") == reply.usage.total_tokens, 5, what="settled to the reported usage")
    record = env.record(client_id)
    assert (record.tenant, record.model, record.served_model) == ("json", "demo-model", "demo-model")
    assert (record.prompt_tokens, record.completion_tokens) == (reply.usage.prompt_tokens,
                                                                reply.usage.completion_tokens)
    assert record.token_source == "reported" and record.status == 200 and not record.cancelled
    assert record.endpoint in {s.address for s in env.stack.sims}
    assert len(record.request_id) > 8 and record.request_id != client_id


def test_tenants_without_budgets_get_no_token_headers(env: Env) -> None:
    raw = env.client().chat.completions.with_raw_response.create(model="demo-model", messages=MSG, max_tokens=2)
    assert raw.parse().choices
    assert not any(h.startswith("x-ratelimit-") for h in raw.headers)


def test_a_client_that_did_not_ask_for_usage_gets_none_but_is_charged_it(env: Env) -> None:
    client_id = rid("hdr")
    raw = env.client("hdr").chat.completions.with_raw_response.create(
        model="demo-model", messages=MSG, max_tokens=9, stream=True, extra_headers={"x-request-id": client_id})
    assert raw.headers["x-ratelimit-limit-tokens"] == str(BIG)  # the binding one of minute and day
    chunks = list(raw.parse())
    assert chunks and all(c.usage is None and c.choices for c in chunks)
    assert sum(len(c.choices[0].delta.content or "") > 0 for c in chunks) > 0
    record = env.record(client_id)
    assert record.token_source == "reported" and record.completion_tokens == 9
    wait_until(lambda: env.charged("hdr") == record.prompt_tokens + 9, 5, what="charged the reported usage")
    # A client that asked gets its usage chunk, as the backend sent it.
    chunks = list(env.client("hdr").chat.completions.create(
        model="demo-model", messages=MSG, max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_two_replicas_sharing_redis_enforce_one_budget(env: Env) -> None:
    client = env.client("shared")
    max_tokens = 40
    admitted: list[tuple[str, int]] = []
    limited: list[openai.RateLimitError] = []

    def one(n: int) -> None:
        client_id = f"shared-{_RUN}-{n}"
        try:
            reply = client.chat.completions.create(model="demo-model", messages=MSG, max_tokens=max_tokens,
                                                   extra_headers={"x-request-id": client_id})
        except openai.RateLimitError as exc:
            limited.append(exc)
            return
        assert reply.usage is not None
        admitted.append((client_id, reply.usage.total_tokens))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(60)))
    assert admitted and limited
    err = limited[0]
    assert err.body["code"] == "tokens_rate_limited"
    assert err.response.headers["retry-after"].isdigit()
    assert err.response.headers["x-ratelimit-limit-tokens"] == str(SHARED_BUDGET)
    used = sum(total for _, total in admitted)
    # One request's reservation: its body (about 100 bytes, so at most 64 tokens at 4 bytes each) + max_tokens.
    one_reservation = 64 + max_tokens
    assert used <= SHARED_BUDGET + one_reservation, (used, len(admitted))
    records = [env.record(client_id) for client_id, _ in admitted]
    assert {r.replica for r in records} == {"extproc", "extproc-1"}  # both replicas admitted some
    wait_until(lambda: env.charged("shared") == used, 5, what="the shared window holds exactly the usage")


def test_a_request_retried_before_the_first_byte_is_charged_once(env: Env) -> None:
    failing, _healthy = env.stack.sims
    failing.fault("status_503")
    client = env.client("retry")
    totals, ids = 0, []
    for _ in range(6):
        client_id = rid("retry")
        reply = client.chat.completions.create(model="demo-model", messages=MSG, max_tokens=5,
                                               extra_headers={"x-request-id": client_id})
        assert reply.usage is not None
        totals += reply.usage.total_tokens
        ids.append(client_id)
    records = [env.record(i) for i in ids]
    assert any(r.retries >= 1 for r in records), records
    assert all(r.endpoint == _healthy.address and r.token_source == "reported" for r in records)
    wait_until(lambda: env.charged("retry") == totals, 5, what="each retried request charged once")


def test_a_cancelled_stream_is_charged_its_reservation(env: Env) -> None:
    client_id = rid("cancel")
    raw = env.client("cancel").chat.completions.with_raw_response.create(
        model="demo-model", messages=MSG, max_tokens=3000, stream=True, stream_options={"include_usage": True},
        extra_headers={"x-request-id": client_id})
    reserved = BIG - int(raw.headers["x-ratelimit-remaining-tokens"])
    stream = raw.parse()
    for n, _chunk in enumerate(stream):
        if n == 3:
            break
    stream.close()
    record = env.record(client_id)
    assert record.cancelled and record.token_source == "estimated"
    assert record.prompt_tokens + record.completion_tokens == reserved
    wait_until(lambda: env.charged("cancel") == reserved, 5, what="charged the reservation")


def test_redis_down_fails_closed_or_open_and_recovers(env: Env) -> None:
    client = env.client("redis")

    def ask() -> None:
        client.chat.completions.create(model="demo-model", messages=MSG, max_tokens=2)

    ask()
    env.redis.stop()
    # Fails closed within the lease lifetime: a replica's lease may admit the tenant's next requests (no
    # Redis involved) for up to LEASE_MS after its grant, then every request needs Redis.
    time.sleep(LEASE_MS / 1000 + 0.2)
    with pytest.raises(openai.InternalServerError) as err:
        ask()
    assert err.value.status_code == 503 and err.value.body["code"] == "rate_limiter_unavailable"
    open_config = copy.deepcopy(env.base)
    open_config["limits"]["redis_fail_open"] = True
    try:
        write_config(env, open_config)
        ask()  # admitted on the local budgets
        env.redis.start()
        ask()
    finally:
        write_config(env, env.base)
    ask()  # fail-closed again, Redis back: admitted
    env.redis.stop()
    time.sleep(LEASE_MS / 1000 + 0.2)
    with pytest.raises(openai.InternalServerError):
        ask()
    env.redis.start()
    wait_until(lambda: _admitted(ask), 10, what="admission after Redis is back")


def _admitted(ask: Any) -> bool:
    try:
        ask()
        return True
    except openai.InternalServerError:
        return False


def write_config(env: Env, data: dict[str, Any]) -> None:
    logs = [env.stack.run_dir / "extproc.log", env.stack.run_dir / "extproc-1.log"]
    before = [p.read_text(errors="replace").count("config reloaded from") for p in logs]
    tmp = env.stack.config_path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    os.replace(tmp, env.stack.config_path)
    wait_until(lambda: all(p.read_text(errors="replace").count("config reloaded from") > b
                           for p, b in zip(logs, before, strict=True)), 15, what="every replica reloaded")


def test_usage_records_match_the_backends_own_token_counters(env: Env) -> None:
    sims = env.stack.sims
    wait_until(lambda: all(s.stats()["running"] == 0 for s in sims), 10, what="backends idle")
    before = sim_tokens(sims)
    started = time.time()
    ids = []
    client = env.client()
    for n in range(6):
        client_id = rid(f"count{n}")
        ids.append(client_id)
        prompt = [{"role": "user", "content": "count " * (n + 1)}]
        if n % 3 == 0:
            client.chat.completions.create(model="demo-model", messages=prompt, max_tokens=4 + n,
                                           extra_headers={"x-request-id": client_id})
        else:
            options = {"include_usage": True} if n % 3 == 1 else None
            list(client.chat.completions.create(
                model="demo-model", messages=prompt, max_tokens=4 + n, stream=True,
                extra_headers={"x-request-id": client_id}, **({"stream_options": options} if options else {})))
    records = [env.record(i) for i in ids]
    after = sim_tokens(sims)
    assert all(r.token_source == "reported" and r.tenant == "acme" and r.ts >= started - 1 for r in records)
    assert sum(r.prompt_tokens for r in records) == after[0] - before[0]
    assert sum(r.completion_tokens for r in records) == after[1] - before[1]
    assert json.loads(records[0].to_json())["v"] == 1


def test_requests_that_need_no_usage_send_no_usage_report(env: Env, tmp_path: Path) -> None:
    """Envoy's usage log is filtered on modeldock:usage: with no budget and records off, nothing is sent."""
    assert sum(env.stack.metric_per_replica("modeldock_usage_reports_total")) > 0  # the main stack hears them
    with running_stack(tmp_path / "plain", backends=1) as plain:
        client = plain.openai()
        client.chat.completions.create(model="demo-model", messages=MSG, max_tokens=3)
        assert list(client.chat.completions.create(model="demo-model", messages=MSG, max_tokens=3, stream=True))
        wait_until(lambda: plain.in_flight() == 0, 5, what="requests ended")
        time.sleep(0.3)  # a report would come within ~20 ms of the end
        assert plain.metric("modeldock_usage_reports_total") == 0
        assert plain.metric("modeldock_usage_pending_settlements") == 0
