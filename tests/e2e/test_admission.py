"""Admission through real Envoy, two ext_proc replicas and a real Redis server the test starts:
a rate limit shared by the replicas, tenant and model limits together, Redis failing closed and
open and coming back, per-tenant concurrency released however a stream ends, key rotation and a
broken config on reload, the bad-input matrix, and keys never written to any log.

The Redis URL reaches the ext_proc replicas only through the REDIS_URL environment variable (the
config sets none), so the shared-limit test also proves that the variable is honoured.
"""

from __future__ import annotations

import copy
import json
import os
import re
import secrets
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from modeldock.config import hash_key
from tests.support.redis_server import RedisServer
from tests.support.stack import API_KEY, RawResponse, Stack, raw_request, running_stack, wait_until

pytestmark = pytest.mark.e2e

MSG = [{"role": "user", "content": "hello"}]
MAX_BODY = 65536
DECISIONS = "modeldock_admission_decisions_total"
# Distinct per run, so finding one in a log cannot be a coincidence.
_RUN = secrets.token_hex(6)
KEYS = {
    name: f"md-adm-{name}-{_RUN}"
    for name in ("shared", "combo", "glob", "aliaskey", "kill", "failopen", "conc", "rot1", "rot2")
}
WRONG_KEY = f"md-adm-wrong-{_RUN}"
# Every key string this module sends; none may appear in any log.
ALL_KEYS = [API_KEY, WRONG_KEY, *KEYS.values()]

SHARED_LIMIT = 10
COMBO_TENANT_LIMIT, COMBO_MODEL_LIMIT = 6, 3
GLOB_LIMIT, ALIASKEY_LIMIT = 3, 2
FAILOPEN_LIMIT = 4
CONC_LIMIT = 2  # per replica
REPLICAS = 2


def _tenants() -> list[dict[str, Any]]:
    def tenant(tid: str, keys: list[str], **limits: Any) -> dict[str, Any]:
        return {"id": tid, "api_key_hashes": [hash_key(k) for k in keys], "models": ["demo-*"], **limits}

    return [
        tenant("shared", [KEYS["shared"]], requests_per_minute=SHARED_LIMIT),
        tenant("combo", [KEYS["combo"]], requests_per_minute=COMBO_TENANT_LIMIT,
               requests_per_minute_per_model={"demo-model": COMBO_MODEL_LIMIT}),
        tenant("glob", [KEYS["glob"]], requests_per_minute_per_model={"demo-*": GLOB_LIMIT}),
        tenant("aliaskey", [KEYS["aliaskey"]], requests_per_minute_per_model={"demo-b": ALIASKEY_LIMIT}),
        tenant("kill", [KEYS["kill"]], requests_per_minute=1000),
        tenant("failopen", [KEYS["failopen"]], requests_per_minute=FAILOPEN_LIMIT),
        tenant("conc", [KEYS["conc"]], max_in_flight=CONC_LIMIT),
        tenant("rot", [KEYS["rot1"], KEYS["rot2"]]),
    ]


@dataclass
class Env:
    stack: Stack
    redis: RedisServer
    base: dict[str, Any]
    base_text: str

    def sims_received(self) -> int:
        """Requests the simulated backends have received, in total."""
        return sum(s.stats()["received"] for s in self.stack.sims)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    captured: dict[str, Any] = {}

    def edit(data: dict[str, Any], sims: Any) -> None:
        data["tenants"].extend(_tenants())
        # An alias on the same backends: a second model for per-model limits.
        data["models"].append({"name": "demo-b", "served_name": "demo-model",
                               "endpoints": [s.address for s in sims]})
        # redis_url deliberately unset: REDIS_URL supplies it. A generous timeout: on a busy 2-core machine a
        # call over the default 50 ms fails closed (503) and, having reached Redis, still takes a slot.
        data["limits"] = {"max_body_bytes": MAX_BODY, "redis_timeout_ms": 2000}
        captured.update(copy.deepcopy(data))

    redis = RedisServer()
    redis.start()  # from the main thread: it dies with the thread that started it
    try:
        # Real-time simulators (20 ms per token), so a stream can be held open.
        with running_stack(tmp_path_factory.mktemp("admission"), edit_config=edit,
                           sim_args=("--step-base-ms", "20", "--speed", "1"),
                           extproc_replicas=REPLICAS, extproc_env={"REDIS_URL": redis.url}) as stack:
            yield Env(stack, redis, captured, stack.config_path.read_text())
    finally:
        redis.close()


@pytest.fixture(autouse=True)
def back_to_normal(env: Env) -> Iterator[None]:
    yield
    if not env.redis.running:
        env.redis.start()
    if env.stack.config_path.read_text() != env.base_text:
        write_config(env, env.base_text)
    wait_until(lambda: env.stack.in_flight() == 0, 15, what="in-flight count back to 0 on every replica")
    dead = env.stack.sup.exited()
    assert dead is None, f"{dead.name} exited:\n{dead.log.read_text()[-3000:]}"


# ---------------------------------------------------------------- helpers


def extproc_health(stack: Stack) -> str:
    """Envoy's view of the ext_proc replicas, for failure messages."""
    return urllib.request.urlopen(f"{stack.admin_url}/stats?filter=modeldock_extproc.health_check",  # noqa: S310
                                  timeout=2).read().decode()


def extproc_logs(stack: Stack) -> list[Path]:
    return [stack.run_dir / ("extproc.log" if i == 0 else f"extproc-{i}.log") for i in range(REPLICAS)]


def count_in_logs(stack: Stack, needle: str) -> list[int]:
    return [log.read_text(errors="replace").count(needle) for log in extproc_logs(stack)]


def write_config(env: Env, text: str, *, expect: str = "config reloaded from", timeout: float = 15) -> float:
    """Replace the config file atomically; wait until every replica logged `expect` once more.
    Returns the seconds that took."""
    before = count_in_logs(env.stack, expect)
    tmp = env.stack.config_path.with_suffix(".tmp")
    tmp.write_text(text)
    started = time.monotonic()
    os.replace(tmp, env.stack.config_path)
    wait_until(lambda: all(a > b for a, b in zip(count_in_logs(env.stack, expect), before, strict=True)),
               timeout, interval=0.05, what=f"every ext_proc replica to log {expect!r}")
    return time.monotonic() - started


def config_with(env: Env, **limits: Any) -> str:
    data = copy.deepcopy(env.base)
    data["limits"].update(limits)
    return yaml.safe_dump(data, sort_keys=False)


def decisions(stack: Stack) -> list[dict[str, float]]:
    """Per replica: admission decisions by outcome, read from its /metrics."""
    out = []
    for port in stack.extproc_metrics_ports:
        text = _metrics_text(port)
        row = {}
        for outcome in ("admitted", "rate_limited", "concurrency_limited", "unavailable"):
            m = re.search(rf'^{DECISIONS}{{outcome="{outcome}"}} (\S+)$', text, re.M)
            row[outcome] = float(m.group(1)) if m else 0.0
        out.append(row)
    return out


def delta(after: list[dict[str, float]], before: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: a[k] - b[k] for k in a} for a, b in zip(after, before, strict=True)]


def _metrics_text(port: int) -> str:
    import urllib.request

    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()  # noqa: S310


def post(stack: Stack, key: str | None, payload: object | bytes, *, extra: list[tuple[str, Any]] | None = None,
         path: str = "/chat/completions") -> RawResponse:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    headers: list[tuple[str, Any]] = [("content-type", "application/json")]
    if key is not None:
        headers.append(("Authorization", f"Bearer {key}"))
    return raw_request("POST", f"{stack.base_url}{path}", body, headers + (extra or []), timeout=30)


def chat(model: str = "demo-model", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": MSG, "max_tokens": 1, **kw}


@dataclass
class Outcome:
    status: int
    headers: dict[str, str]
    error: dict[str, Any] | None = None
    exc: BaseException | None = None


def burst(stack: Stack, key: str, n: int, model: str = "demo-model") -> list[Outcome]:
    """n requests at once through the openai SDK, released together by a barrier."""
    client = stack.openai(api_key=key, timeout=60)
    gate = threading.Barrier(n)

    def one(_: int) -> Outcome:
        gate.wait(30)
        try:
            raw = client.chat.completions.with_raw_response.create(model=model, messages=MSG, max_tokens=1)
            completion = raw.parse()
            assert completion.choices[0].message.content is not None
            return Outcome(raw.status_code, {k.lower(): v for k, v in raw.headers.items()})
        except openai.APIStatusError as exc:
            return Outcome(exc.status_code, {k.lower(): v for k, v in exc.response.headers.items()},
                           exc.body if isinstance(exc.body, dict) else None, exc)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def statuses(results: list[Outcome]) -> dict[str, int]:
    """Counts by status and error code, for assertion messages."""
    from collections import Counter

    return dict(Counter(f"{r.status} {r.error['code'] if r.error else ''}".strip() for r in results))


def assert_openai_error(r: RawResponse, status: int, codes: str | tuple[str, ...]) -> dict[str, Any]:
    assert r.status == status, f"expected {status}, got {r.status}: {r.body[:300]!r}"
    assert r.headers.get("content-type") == "application/json", r.headers
    err = r.json()["error"]
    codes = (codes,) if isinstance(codes, str) else codes
    assert err["code"] in codes, err
    assert err["message"] and err["type"] and "param" in err
    return err


# ---------------------------------------------------------------- rate limits shared through Redis


def test_two_replicas_share_one_limit(env: Env) -> None:
    stack, n = env.stack, 48
    before, received_before = decisions(stack), env.sims_received()
    results = burst(stack, KEYS["shared"], n)

    ok = [r for r in results if r.status == 200]
    limited = [r for r in results if r.status == 429]
    assert len(ok) == SHARED_LIMIT and len(limited) == n - SHARED_LIMIT, statuses(results)
    # Each admission took its own slot in the one shared window.
    assert sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in ok) == list(range(SHARED_LIMIT))
    for r in ok:
        assert r.headers["x-ratelimit-limit-requests"] == str(SHARED_LIMIT)
        assert r.headers["x-ratelimit-reset-requests"] == "1m0s"  # right after an admission: the whole window
    for r in limited:
        assert isinstance(r.exc, openai.RateLimitError)
        assert r.error is not None and r.error["code"] == "rate_limit_exceeded"
        assert "tenant shared" in r.error["message"]
        assert 1 <= int(r.headers["retry-after"]) <= 60
        assert r.headers["x-ratelimit-limit-requests"] == str(SHARED_LIMIT)
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert re.fullmatch(r"\d+(\.\d+)?(ms|s)|1m0s", r.headers["x-ratelimit-reset-requests"])
    # Rejected requests never reached a backend.
    assert env.sims_received() - received_before == SHARED_LIMIT

    per_replica = delta(decisions(stack), before)
    assert sum(d["admitted"] for d in per_replica) == SHARED_LIMIT
    assert sum(d["rate_limited"] for d in per_replica) == n - SHARED_LIMIT
    for d in per_replica:
        # Each replica saw more requests than the limit, so only the shared window can have held
        # the total to the limit (a per-replica window would have admitted up to 2x).
        assert d["admitted"] + d["rate_limited"] > SHARED_LIMIT, (per_replica, extproc_health(stack))


def test_tenant_and_model_limits_together_and_an_alias_shares_the_model_window(env: Env) -> None:
    stack = env.stack
    first = burst(stack, KEYS["combo"], 10, model="demo-model")
    ok = [r for r in first if r.status == 200]
    assert len(ok) == COMBO_MODEL_LIMIT, statuses(first)
    # The per-model limit binds (fewest slots left), so the headers report it.
    assert {r.headers["x-ratelimit-limit-requests"] for r in ok} == {str(COMBO_MODEL_LIMIT)}
    assert sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in ok) == list(range(COMBO_MODEL_LIMIT))
    for r in first:
        if r.status != 200:
            assert r.status == 429 and r.error is not None
            assert "tenant combo on model demo-model" in r.error["message"], r.error

    # demo-b is a public alias served as demo-model: the same window (in Redis, across both replicas),
    # so the alias does not get the tenant around the model's limit.
    received = env.sims_received()
    second = burst(stack, KEYS["combo"], 10, model="demo-b")
    assert statuses(second) == {"429 rate_limit_exceeded": 10}
    for r in second:
        assert r.error is not None
        assert "tenant combo on model demo-model (requested as demo-b)" in r.error["message"], r.error
        assert r.headers["x-ratelimit-limit-requests"] == str(COMBO_MODEL_LIMIT)
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert env.sims_received() == received


def test_per_model_keys_are_globs_and_cover_every_name_of_the_served_model(env: Env) -> None:
    stack = env.stack
    # "demo-*" matches both public names; they serve one model, so they share one window of GLOB_LIMIT.
    models = ["demo-model", "demo-b"] * 4
    results = [post(stack, KEYS["glob"], chat(m)) for m in models]
    assert [r.status for r in results].count(200) == GLOB_LIMIT, [r.status for r in results]
    assert all(r.status == 200 for r in results[:GLOB_LIMIT])
    for r in results[GLOB_LIMIT:]:
        assert_openai_error(r, 429, "rate_limit_exceeded")
    # A key naming the alias limits the model it serves, whichever name is sent.
    results = [post(stack, KEYS["aliaskey"], chat("demo-model")) for _ in range(ALIASKEY_LIMIT + 2)]
    assert [r.status for r in results] == [200] * ALIASKEY_LIMIT + [429, 429]
    assert "on model demo-model" in results[-1].json()["error"]["message"]


def test_redis_down_fails_closed_then_recovers_on_same_port(env: Env) -> None:
    stack, key = env.stack, KEYS["kill"]
    assert post(stack, key, chat()).status == 200
    errors_before = sum(stack.metric_per_replica("modeldock_admission_redis_errors_total"))
    env.redis.stop()

    client = stack.openai(api_key=key)
    for _ in range(4):
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="demo-model", messages=MSG, max_tokens=1)
        assert info.value.status_code == 503
        assert info.value.body["code"] == "rate_limiter_unavailable"
        assert info.value.body["type"] == "server_error"
        assert "Rate limiting is unavailable" in info.value.body["message"]
        assert info.value.response.headers["retry-after"] == "1"
    # A tenant without rate limits never needs Redis.
    assert post(stack, API_KEY, chat()).status == 200
    assert sum(stack.metric_per_replica("modeldock_admission_redis_errors_total")) >= errors_before + 4

    env.redis.start()  # same port, empty
    # The next call on each replica reconnects; no restart of ext_proc.
    wait_until(lambda: post(stack, key, chat()).status == 200, 10, what="admission to recover with Redis")
    for _ in range(6):
        r = post(stack, key, chat())
        assert r.status == 200, r.body
        assert r.headers["x-ratelimit-limit-requests"] == "1000"


def test_redis_killed_during_a_burst_every_answer_is_a_pass_or_a_clear_503(env: Env) -> None:
    stack, key, n = env.stack, KEYS["kill"], 40
    client = stack.openai(api_key=key, timeout=30)

    def one(i: int) -> Outcome:
        time.sleep(i * 0.05)  # spread over 2 s; Redis dies once the first one has passed
        try:
            raw = client.chat.completions.with_raw_response.create(model="demo-model", messages=MSG, max_tokens=1)
            return Outcome(raw.status_code, dict(raw.headers))
        except openai.APIStatusError as exc:
            body = exc.body if isinstance(exc.body, dict) else None
            return Outcome(exc.status_code, dict(exc.response.headers), body)

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        wait_until(lambda: futures[0].done(), 15, what="the first request of the burst")
        env.redis.stop()
        results = [f.result() for f in futures]
    counts = statuses(results)
    assert set(counts) <= {"200", "503 rate_limiter_unavailable"}, counts
    assert counts.get("200") and counts.get("503 rate_limiter_unavailable"), counts
    wait_until(lambda: stack.in_flight() == 0, 10, what="in-flight count back to 0")
    env.redis.start()
    wait_until(lambda: post(stack, key, chat()).status == 200, 10, what="admission to recover with Redis")


def test_redis_down_with_fail_open_admits_on_each_replicas_local_window(env: Env) -> None:
    stack = env.stack
    write_config(env, config_with(env, redis_fail_open=True))
    env.redis.stop()
    fail_open_before = sum(stack.metric_per_replica("modeldock_admission_fail_open_total"))
    before = decisions(stack)

    results = burst(stack, KEYS["failopen"], 16)
    per_replica = delta(decisions(stack), before)
    admitted = [r for r in results if r.status == 200]
    assert {r.status for r in results} <= {200, 429}
    for d in per_replica:
        seen = d["admitted"] + d["rate_limited"]
        # Without Redis, each replica's own window still holds it to the limit.
        assert d["admitted"] == min(seen, FAILOPEN_LIMIT), per_replica
    assert len(admitted) == sum(d["admitted"] for d in per_replica)
    assert FAILOPEN_LIMIT <= len(admitted) <= REPLICAS * FAILOPEN_LIMIT
    assert sum(stack.metric_per_replica("modeldock_admission_fail_open_total")) - fail_open_before == len(admitted)
    for r in admitted:
        assert r.headers["x-ratelimit-limit-requests"] == str(FAILOPEN_LIMIT)

    # Back to failing closed, still without Redis.
    write_config(env, env.base_text)
    assert_openai_error(post(stack, KEYS["kill"], chat()), 503, "rate_limiter_unavailable")
    env.redis.start()
    wait_until(lambda: post(stack, KEYS["kill"], chat()).status == 200, 10, what="admission to recover")


# ---------------------------------------------------------------- max_in_flight


class HeldStream:
    """A streaming request over a raw socket, so the test decides when the client leaves."""

    def __init__(self, stack: Stack, key: str, max_tokens: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", stack.port), timeout=30)
        body = json.dumps(chat(stream=True, max_tokens=max_tokens)).encode()
        self.sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {key}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body
        )
        self.buf = b""
        while b"\r\n\r\n" not in self.buf:
            self._recv()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        self.status = int(head.split(b" ", 2)[1])
        self.headers = {k.strip().lower(): v.strip() for k, _, v in
                        (line.decode().partition(":") for line in head.split(b"\r\n")[1:])}
        if self.status == 200:
            while b"data: " not in self.buf:  # the first SSE chunk: admitted and streaming
                self._recv()
        else:
            length = int(self.headers.get("content-length", "0"))
            while len(self.buf) < length:
                self._recv()
            self.close()

    def _recv(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("closed early")
        self.buf += data

    def error(self) -> dict[str, Any]:
        return json.loads(self.buf)["error"]

    def read_to_end(self) -> None:
        while b"data: [DONE]" not in self.buf:
            self._recv()
        self.close()

    def close(self) -> None:
        self.sock.close()


def hold(stack: Stack, n: int, max_tokens: int) -> tuple[list[HeldStream], list[HeldStream]]:
    gate = threading.Barrier(n)

    def one(_: int) -> HeldStream:
        gate.wait(30)
        return HeldStream(stack, KEYS["conc"], max_tokens)

    with ThreadPoolExecutor(n) as pool:
        streams = list(pool.map(one, range(n)))
    return [s for s in streams if s.status == 200], [s for s in streams if s.status != 200]


def test_max_in_flight_is_released_when_the_stream_ends_or_the_client_leaves(env: Env) -> None:
    stack, n, allowed = env.stack, 12, REPLICAS * CONC_LIMIT  # max_in_flight counts per replica

    def round_of(max_tokens: int) -> list[HeldStream]:
        before = decisions(stack)
        held, refused = hold(stack, n, max_tokens)
        assert len(held) == allowed, f"{len(held)} admitted, expected {allowed}"
        for s in refused:
            assert s.status == 429 and s.headers["retry-after"] == "1"
            assert s.error()["code"] == "concurrency_limit_exceeded"
        per_replica = delta(decisions(stack), before)
        assert [d["admitted"] for d in per_replica] == [CONC_LIMIT] * REPLICAS, per_replica
        assert stack.in_flight() == allowed
        return held

    # 1. The client leaves mid-stream: every slot comes back.
    for s in round_of(max_tokens=2000):
        s.close()
    wait_until(lambda: stack.in_flight() == 0, 10, what="slots released after client disconnects")
    # 2. The slots really are free (a leaked one would admit fewer); these streams end normally.
    for s in round_of(max_tokens=100):
        s.read_to_end()
    wait_until(lambda: stack.in_flight() == 0, 10, what="slots released after streams completed")
    # 3. And free again after normal completion.
    for s in round_of(max_tokens=2000):
        s.close()
    wait_until(lambda: stack.in_flight() == 0, 10, what="slots released")
    assert sum(stack.metric_per_replica("modeldock_extproc_streams")) == 0


# ---------------------------------------------------------------- reload: key rotation, broken config


def test_key_rotation_and_broken_config_on_reload(env: Env) -> None:
    stack = env.stack
    for key in (KEYS["rot1"], KEYS["rot2"]):
        for _ in range(4):  # both replicas
            assert post(stack, key, chat()).status == 200

    rotated = copy.deepcopy(env.base)
    rot = next(t for t in rotated["tenants"] if t["id"] == "rot")
    rot["api_key_hashes"] = [hash_key(KEYS["rot2"])]
    rotated_text = yaml.safe_dump(rotated, sort_keys=False)
    started = time.monotonic()
    tmp = stack.config_path.with_suffix(".tmp")
    tmp.write_text(rotated_text)
    os.replace(tmp, stack.config_path)

    def old_key_refused() -> bool:
        return all(post(stack, KEYS["rot1"], chat()).status == 401 for _ in range(REPLICAS * 2))

    wait_until(old_key_refused, 10, interval=0.1, what="the removed key to be refused on every replica")
    took = time.monotonic() - started
    assert took < 5, f"the removed key still worked {took:.1f}s after the config changed"
    err = assert_openai_error(post(stack, KEYS["rot1"], chat()), 401, "invalid_api_key")
    assert KEYS["rot1"] not in json.dumps(err)
    for _ in range(4):
        assert post(stack, KEYS["rot2"], chat()).status == 200

    # A broken file mid-run: the last good config (the rotated one) stays in force, and the log says why.
    broken = copy.deepcopy(rotated)
    broken["tenants"][0]["requests_per_minute"] = "lots"
    write_config(env, yaml.safe_dump(broken, sort_keys=False),
                 expect="config reload failed; keeping the last good config")
    for log in extproc_logs(stack):
        assert "tenants[0].requests_per_minute" in log.read_text(errors="replace")
    write_config(env, "tenants: [ {id: oops\n", expect="not valid YAML")
    for _ in range(4):
        assert post(stack, KEYS["rot2"], chat()).status == 200
        assert post(stack, API_KEY, chat()).status == 200
        assert post(stack, KEYS["rot1"], chat()).status == 401


# ---------------------------------------------------------------- bad input


def chunked_request(stack: Stack, body: bytes, headers: list[tuple[str, str]], chunk: int = 16384) -> RawResponse:
    """POST with Transfer-Encoding: chunked; the server may answer before the body is all sent."""
    sock = socket.create_connection(("127.0.0.1", stack.port), timeout=30)
    try:
        head = "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ntransfer-encoding: chunked\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
        sock.sendall(head.encode())
        try:
            for i in range(0, len(body), chunk):
                piece = body[i:i + chunk]
                sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # answered and closed early; read what it said
        data = b""
        while True:
            try:
                got = sock.recv(65536)
            except OSError:
                break
            if not got:
                break
            data += got
            head_end = data.find(b"\r\n\r\n")
            if head_end >= 0:
                m = re.search(rb"\r\ncontent-length: *(\d+)", data[:head_end], re.I)
                if m and len(data) - head_end - 4 >= int(m.group(1)):
                    break
        head_bytes, _, rest = data.partition(b"\r\n\r\n")
        lines = head_bytes.decode("latin-1").split("\r\n")
        hdrs = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        return RawResponse(int(lines[0].split(" ", 2)[1]), hdrs, rest)
    finally:
        sock.close()


def _big(n: int) -> bytes:
    return json.dumps(chat(pad="x" * n)).encode()


AUTH = ("Authorization", f"Bearer {API_KEY}")
CT = ("content-type", "application/json")
OK_BODY = json.dumps(chat()).encode()

Send = Callable[[Stack], RawResponse]
# The OpenAI error type each status carries.
ERROR_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
              404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def case(name: str, send: Send, status: int, codes: str | tuple[str, ...]) -> Any:
    """One row of the bad-input matrix: how to send it, the status, the error code(s) it must get."""
    return pytest.param(send, status, codes, id=name)


def call(method: str, path: str, body: bytes | None = None, key: str | None = API_KEY) -> Send:
    """A request with any method and path under /v1."""
    headers = [CT] + ([("Authorization", f"Bearer {key}")] if key is not None else [])
    return lambda s: raw_request(method, f"{s.base_url}{path}", body, headers, timeout=30)


def nested(depth: int) -> bytes:
    return b'{"model":"demo-model","x":' + b'{"a":' * depth + b"1" + b"}" * depth + b"}"


# Append rows here; each one is sent alone and then followed by a normal request.
BAD_INPUTS: list[Any] = [
    # Size
    case("too-large-content-length", lambda s: post(s, API_KEY, _big(MAX_BODY)), 413, "request_too_large"),
    case("too-large-chunked", lambda s: chunked_request(s, _big(MAX_BODY), [AUTH, CT]), 413, "request_too_large"),
    case("too-large-chunked-beyond-envoy-buffer",
         lambda s: chunked_request(s, _big(MAX_BODY + 2 * 1024 * 1024), [AUTH, CT]), 413, "request_too_large"),
    case("too-large-completions-endpoint", lambda s: post(s, API_KEY, _big(MAX_BODY), path="/completions"), 413,
         "request_too_large"),
    # Body: not JSON, or JSON that is not a request
    case("empty-body", lambda s: post(s, API_KEY, b""), 400, "invalid_body"),
    case("whitespace-body", lambda s: post(s, API_KEY, b"  \r\n\t "), 400, "invalid_body"),
    case("not-json", lambda s: post(s, API_KEY, b"{model: demo-model"), 400, "invalid_json"),
    case("truncated-json", lambda s: post(s, API_KEY, OK_BODY[:-1]), 400, "invalid_json"),
    case("json-trailing-garbage", lambda s: post(s, API_KEY, OK_BODY + b"}"), 400, "invalid_json"),
    case("not-json-completions-endpoint", lambda s: post(s, API_KEY, b"prompt=hi", path="/completions"), 400,
         "invalid_json"),
    case("json-nested-30000-deep", lambda s: post(s, API_KEY, b"[" * 30000 + b"]" * 30000), 400, "invalid_json"),
    case("json-objects-nested-10000-deep", lambda s: post(s, API_KEY, nested(10000)), 400, "invalid_json"),
    case("json-5000-digit-integer",
         lambda s: post(s, API_KEY, b'{"model":"demo-model","n":' + b"9" * 5000 + b"}"), 400,
         ("invalid_json", "invalid_body")),
    case("json-nan", lambda s: post(s, API_KEY, b'{"model":"demo-model","temperature":NaN}'), 400, "invalid_json"),
    case("json-infinity", lambda s: post(s, API_KEY, b'{"model":"demo-model","temperature":-Infinity}'), 400,
         "invalid_json"),
    case("json-float-overflow", lambda s: post(s, API_KEY, b'{"model":"demo-model","temperature":1e999}'), 400,
         "invalid_json"),
    case("json-array", lambda s: post(s, API_KEY, b'[{"model":"demo-model"}]'), 400, "invalid_body"),
    case("json-string", lambda s: post(s, API_KEY, b'"demo-model"'), 400, "invalid_body"),
    case("json-number", lambda s: post(s, API_KEY, b"42"), 400, "invalid_body"),
    case("json-null", lambda s: post(s, API_KEY, b"null"), 400, "invalid_body"),
    case("body-not-utf8", lambda s: post(s, API_KEY, b'{"model":"demo-\xff\xfe"}'), 400, "invalid_body"),
    case("body-utf16", lambda s: post(s, API_KEY, json.dumps(chat()).encode("utf-16")), 400, "invalid_body"),
    case("body-utf8-bom", lambda s: post(s, API_KEY, b"\xef\xbb\xbf" + OK_BODY), 400, "invalid_json"),
    # The model field
    case("model-missing", lambda s: post(s, API_KEY, {"messages": MSG}), 400, "missing_model"),
    case("model-null", lambda s: post(s, API_KEY, {"model": None}), 400, "missing_model"),
    case("model-int", lambda s: post(s, API_KEY, {"model": 7}), 400, "invalid_model"),
    case("model-bool", lambda s: post(s, API_KEY, {"model": True}), 400, "invalid_model"),
    case("model-list", lambda s: post(s, API_KEY, {"model": ["demo-model"]}), 400, "invalid_model"),
    case("model-object", lambda s: post(s, API_KEY, {"model": {"name": "demo-model"}}), 400, "invalid_model"),
    case("model-empty", lambda s: post(s, API_KEY, chat("")), 400, "invalid_model"),
    case("model-crlf", lambda s: post(s, API_KEY, chat("demo-model\r\nx-injected: 1")), 400, "invalid_model"),
    case("model-nul", lambda s: post(s, API_KEY, chat("demo-model\x00")), 400, "invalid_model"),
    case("model-tab", lambda s: post(s, API_KEY, chat("demo\tmodel")), 400, "invalid_model"),
    case("model-del", lambda s: post(s, API_KEY, chat("demo-model\x7f")), 400, "invalid_model"),
    case("model-300-chars", lambda s: post(s, API_KEY, chat("demo-" + "m" * 300)), 400, "invalid_model"),
    case("model-unknown", lambda s: post(s, API_KEY, chat("no-such-model")), 404, "model_not_found"),
    # Paths and methods
    case("unknown-path-with-body", lambda s: post(s, API_KEY, OK_BODY, path="/embeddings"), 404, "unknown_url"),
    case("completions-path-trailing-slash", lambda s: post(s, API_KEY, OK_BODY, path="/chat/completions/"), 404,
         "unknown_url"),
    case("unknown-path-without-body", call("GET", "/nothing-here"), 404, "unknown_url"),
    case("get-chat-completions", call("GET", "/chat/completions"), 400, "method_not_allowed"),
    case("put-chat-completions", call("PUT", "/chat/completions", OK_BODY), 400, "method_not_allowed"),
    case("delete-completions", call("DELETE", "/completions", OK_BODY), 400, "method_not_allowed"),
    case("post-models", call("POST", "/models", OK_BODY), 400, "method_not_allowed"),
    # Keys
    case("unknown-key", lambda s: post(s, WRONG_KEY, OK_BODY), 401, "invalid_api_key"),
    case("empty-bearer-key", lambda s: post(s, None, OK_BODY, extra=[("Authorization", "Bearer ")]), 401,
         "missing_api_key"),
    case("empty-authorization", lambda s: post(s, None, OK_BODY, extra=[("Authorization", "")]), 401,
         "missing_api_key"),
    case("no-authorization", lambda s: post(s, None, OK_BODY), 401, "missing_api_key"),
    case("models-without-key", call("GET", "/models", key=None), 401, "missing_api_key"),
    case("models-unknown-key", call("GET", "/models", key=WRONG_KEY), 401, "invalid_api_key"),
    # Envoy joins repeated Authorization headers into one value, which then matches no key.
    case("duplicate-authorization-same-key", lambda s: post(s, API_KEY, OK_BODY, extra=[AUTH]), 401,
         ("invalid_authorization", "invalid_api_key")),
    case("duplicate-authorization-other-key", lambda s: post(s, WRONG_KEY, OK_BODY, extra=[AUTH]), 401,
         ("invalid_authorization", "invalid_api_key")),
    case("basic-scheme", lambda s: post(s, None, OK_BODY, extra=[("Authorization", "Basic dXNlcjpwYXNz")]), 401,
         "invalid_authorization"),
    case("key-with-inner-space", lambda s: post(s, None, OK_BODY, extra=[("Authorization", f"Bearer {API_KEY} x")]),
         401, "invalid_api_key"),
    case("key-not-utf8", lambda s: post(s, None, OK_BODY, extra=[("Authorization", b"Bearer \xff\xfe\x80")]),
         401, "invalid_api_key"),
]


@pytest.mark.parametrize(("send", "status", "codes"), BAD_INPUTS)
def test_bad_input_gets_a_clear_openai_error(env: Env, send: Send, status: int, codes: str | tuple[str, ...]) -> None:
    stack = env.stack
    logs = extproc_logs(stack)
    offsets = [log.stat().st_size for log in logs]
    received = env.sims_received()
    r = send(stack)
    err = assert_openai_error(r, status, codes)
    assert err["type"] == ERROR_TYPE[status], err
    assert API_KEY not in r.body.decode(errors="replace")
    assert env.sims_received() == received, "a rejected request reached a backend"
    # Nothing crashed, nothing leaked, and the gateway still serves.
    ok = post(stack, API_KEY, chat())
    assert ok.status == 200, ok.body
    wait_until(lambda: stack.in_flight() == 0, 10, what="in-flight count back to 0")
    for log, offset in zip(logs, offsets, strict=True):
        with log.open("rb") as f:
            f.seek(offset)
            new = f.read().decode(errors="replace")
        assert "Traceback" not in new and "stream failed" not in new, new[-3000:]


def test_after_the_bad_inputs_nothing_is_left_counted(env: Env) -> None:
    """Every bad input above ran first: the gateway still serves, and every count of requests in flight
    (ext_proc's, the picker's per endpoint, admission's tickets) is back to 0 on every replica."""
    stack = env.stack
    client = stack.openai(timeout=30)
    done = client.chat.completions.create(model="demo-model", messages=MSG, max_tokens=1)
    assert done.choices[0].message.content is not None

    def counts() -> list[tuple[float, dict[str, float], float]]:
        out = []
        for port in stack.extproc_metrics_ports:
            text = _metrics_text(port)
            per_endpoint = {m.group(1): float(m.group(2))
                            for m in re.finditer(r"^modeldock_picker_in_flight(\{[^}]*\}) (\S+)$", text, re.M)}
            admission = re.search(r"^modeldock_admission_in_flight (\S+)$", text, re.M)
            in_flight = re.search(r"^modeldock_in_flight (\S+)$", text, re.M)
            assert per_endpoint and admission and in_flight, text[-2000:]
            out.append((float(in_flight.group(1)), per_endpoint, float(admission.group(1))))
        return out

    wait_until(lambda: all(a == 0 and not any(e.values()) and c == 0 for a, e, c in counts()), 10,
               what="every in-flight count back to 0")
    for _, per_endpoint, _ in counts():  # the picker's gauge covers every backend
        assert all(any(sim.address in labels for labels in per_endpoint) for sim in stack.sims), per_endpoint


# ---------------------------------------------------------------- secrets


def test_no_key_in_any_log(env: Env) -> None:
    """Runs last: every process ran at --log-level debug (Envoy at warn, with its access log)."""
    stack = env.stack
    # Make sure the logs hold at least one of each kind of request, whatever ran before.
    assert post(stack, API_KEY, chat()).status == 200
    assert post(stack, WRONG_KEY, chat()).status == 401
    assert post(stack, None, OK_BODY, extra=[("Authorization", f"Basic {API_KEY}")]).status == 401
    assert post(stack, KEYS["kill"], chat()).status == 200  # a tenant with a window in Redis
    files = [*stack.run_dir.glob("*.log"), *env.redis.dir.glob("*.log"), stack.config_path]
    assert len([f for f in files if f.name.startswith("extproc")]) == REPLICAS
    for path in files:
        text = path.read_bytes().decode("utf-8", errors="replace")
        for key in ALL_KEYS:
            assert key not in text, f"{path.name} contains an API key"
    # Nor in Redis: its keys name tenants and models only.
    import redis as redis_lib

    client = redis_lib.Redis.from_url(env.redis.url)
    try:
        names = [k.decode() for k in client.keys("*")]
    finally:
        client.close()
    assert names, "the shared windows live in Redis"
    assert "modeldock:{load}:replicas" in names  # the replicas' shared load state (modeldock/sharing)
    for name in names:
        assert name.startswith("modeldock:rl:{") or name == "modeldock:{load}:replicas"
        assert not any(key in name for key in ALL_KEYS)
