"""What a rejected client and the operator are told: the 503 when Redis is down (fail closed), the
429 when Redis refuses what the local window allowed, and the concurrency 429. The messages and
headers are the API; the log line must carry the reason."""

from __future__ import annotations

import logging

import pytest

from modeldock.admission.limits import Admission
from modeldock.clock import FakeClock
from modeldock.errors import RateLimited, Unavailable
from tests.support.redis_server import RedisServer
from tests.unit.admission.admission_helpers import config, tenant


async def test_redis_down_fail_closed_is_a_503_with_retry_after_and_a_logged_reason(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    t = tenant(rpm=10)
    admission = Admission(config(t, redis_url=redis_server.url, redis_timeout_ms=300), FakeClock())
    try:
        await admission.admit(t, "m")
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="modeldock"), pytest.raises(Unavailable) as info:
            await admission.admit(t, "m")
        assert str(info.value) == ("Rate limiting is unavailable right now, so the request was not admitted. "
                                   "Retry shortly.")
        assert info.value.code == "rate_limiter_unavailable"
        assert info.value.headers == {"Retry-After": "1"}
        lines = [r.getMessage() for r in caplog.records if "rejecting requests with 503" in r.getMessage()]
        assert len(lines) == 1
        assert lines[0].startswith("Redis rate limiting failed (") and "(None)" not in lines[0]
        assert "Error" in lines[0]  # the reason: the exception type and text
    finally:
        await admission.close()


async def test_redis_down_fail_open_logs_the_reason(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    t = tenant(rpm=10)
    admission = Admission(config(t, redis_url=redis_server.url, redis_timeout_ms=300, redis_fail_open=True),
                          FakeClock())
    try:
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="modeldock"):
            await admission.admit(t, "m")
        [line] = [r.getMessage() for r in caplog.records if "redis_fail_open" in r.getMessage()]
        assert line.startswith("Redis rate limiting failed (") and "(None)" not in line and "Error" in line
    finally:
        await admission.close()


@pytest.mark.parametrize(("per_model", "label"), [(None, "tenant acme"), ({"m": 1}, "tenant acme on model m")])
async def test_redis_refusal_names_the_limit_that_was_reached(
    redis_server: RedisServer, per_model: dict[str, int] | None, label: str
) -> None:
    t = tenant(rpm=1 if per_model is None else 10, per_model=per_model)
    cfg = config(t, redis_url=redis_server.url, redis_timeout_ms=500)
    # Two replicas: the second one's local window is empty, so only Redis can refuse.
    a, b = Admission(cfg, FakeClock()), Admission(cfg, FakeClock())
    try:
        (await a.admit(t, "m")).release()
        with pytest.raises(RateLimited) as info:
            await b.admit(t, "m")
        assert str(info.value).startswith(f"Rate limit reached for requests per minute for {label} (limit 1). ")
        assert b.in_flight(t.id) == 0
    finally:
        await a.close()
        await b.close()


async def test_concurrency_refusal_says_when_to_retry() -> None:
    t = tenant(max_in_flight=1)
    admission = Admission(config(t), FakeClock())
    ticket = await admission.admit(t, "m")
    with pytest.raises(RateLimited) as info:
        await admission.admit(t, "m")
    assert str(info.value) == ("Too many requests in flight for tenant acme (limit 1). "
                               "Retry when an earlier request finishes.")
    assert info.value.code == "concurrency_limit_exceeded"
    assert info.value.headers == {"Retry-After": "1"}
    ticket.release()
    await admission.close()
