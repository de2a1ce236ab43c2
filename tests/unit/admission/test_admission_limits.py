"""Admission without Redis: local windows, concurrency, headers, reload, metrics."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from modeldock.admission.limits import Admission
from modeldock.clock import FakeClock
from modeldock.errors import RateLimited
from tests.unit.admission.admission_helpers import config, tenant


async def test_tenant_window_headers_and_retry_after() -> None:
    clock = FakeClock()
    t = tenant(rpm=3)
    admission = Admission(config(t), clock)
    first = await admission.admit(t, "m")
    assert first.headers == {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "1m0s",
    }
    clock.advance(12)
    await admission.admit(t, "m")
    clock.advance(0.35)
    third = await admission.admit(t, "m")
    assert third.headers["x-ratelimit-remaining-requests"] == "0"

    clock.advance(0.15)  # oldest admission was 12.5 s ago
    with pytest.raises(RateLimited) as caught:
        await admission.admit(t, "m")
    err = caught.value
    assert err.status == 429 and err.code == "rate_limit_exceeded"
    assert err.headers == {
        "Retry-After": "48",  # 47.5 s rounded up
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "59.85s",
    }
    assert "47.5s" in err.message and "limit 3" in err.message

    clock.advance(47.5)
    assert (await admission.admit(t, "m")).headers["x-ratelimit-remaining-requests"] == "0"
    assert admission.metrics.decisions == {
        "admitted": 4,
        "rate_limited": 1,
        "concurrency_limited": 0,
        "unavailable": 0,
    }


async def test_per_model_limit_is_separate_from_the_tenant_limit() -> None:
    t = tenant(rpm=10, per_model={"big": 2})
    admission = Admission(config(t), FakeClock())
    await admission.admit(t, "big")
    ticket = await admission.admit(t, "big")
    # The per-model limit is the tighter one, so it is the one reported.
    assert ticket.headers["x-ratelimit-limit-requests"] == "2"
    assert ticket.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(RateLimited) as caught:
        await admission.admit(t, "big")
    assert "model big" in caught.value.message
    # Other models still have the tenant limit; the rejected request took none of it.
    for expected_remaining in range(7, -1, -1):
        ticket = await admission.admit(t, "small")
        assert ticket.headers["x-ratelimit-remaining-requests"] == str(expected_remaining)
    with pytest.raises(RateLimited):
        await admission.admit(t, "small")


async def test_per_model_limit_without_a_tenant_limit() -> None:
    t = tenant(per_model={"big": 1})
    admission = Admission(config(t), FakeClock())
    await admission.admit(t, "big")
    with pytest.raises(RateLimited):
        await admission.admit(t, "big")
    assert (await admission.admit(t, "other")).headers == {}


async def test_no_limits_means_no_headers() -> None:
    t = tenant()
    admission = Admission(config(t), FakeClock())
    for _ in range(1000):
        ticket = await admission.admit(t, "m")
        assert ticket.headers == {}
        ticket.release()


async def test_concurrency_limit_and_idempotent_release() -> None:
    t = tenant(max_in_flight=2)
    admission = Admission(config(t), FakeClock())
    a = await admission.admit(t, "m")
    b = await admission.admit(t, "m")
    with pytest.raises(RateLimited) as caught:
        await admission.admit(t, "m")
    assert caught.value.code == "concurrency_limit_exceeded"
    assert caught.value.headers == {"Retry-After": "1"}
    a.release()
    a.release()
    assert admission.in_flight(t.id) == 1
    with await admission.admit(t, "m") as c:
        assert admission.in_flight(t.id) == 2
    assert c.released
    b.release()
    assert admission.in_flight(t.id) == 0


async def test_window_rejection_releases_the_concurrency_slot() -> None:
    t = tenant(rpm=1, max_in_flight=5)
    admission = Admission(config(t), FakeClock())
    await admission.admit(t, "m")
    for _ in range(10):
        with pytest.raises(RateLimited):
            await admission.admit(t, "m")
    assert admission.in_flight(t.id) == 1


async def test_concurrency_rejection_takes_no_window_slot() -> None:
    clock = FakeClock()
    t = tenant(rpm=2, max_in_flight=1)
    admission = Admission(config(t), clock)
    held = await admission.admit(t, "m")
    for _ in range(10):
        with pytest.raises(RateLimited):
            await admission.admit(t, "m")
    held.release()
    # Only one window slot was used, so one more request fits.
    ticket = await admission.admit(t, "m")
    assert ticket.headers["x-ratelimit-remaining-requests"] == "0"


async def test_reconfigure_keeps_window_state_and_applies_new_limits() -> None:
    t = tenant(rpm=5, max_in_flight=10)
    admission = Admission(config(t), FakeClock())
    tickets = [await admission.admit(t, "m") for _ in range(3)]

    lowered = tenant(rpm=4, max_in_flight=3)
    admission.reconfigure(config(lowered))
    with pytest.raises(RateLimited):
        await admission.admit(lowered, "m")  # 3 in flight already
    tickets[0].release()  # a ticket from before the reload still frees its slot
    await admission.admit(lowered, "m")
    tickets[1].release()
    with pytest.raises(RateLimited) as caught:
        await admission.admit(lowered, "m")  # 4 of 4 used in the window
    assert caught.value.code == "rate_limit_exceeded"
    await admission.close()


async def test_cancelled_admit_holds_nothing() -> None:
    t = tenant(rpm=1, max_in_flight=1)
    admission = Admission(config(t), FakeClock())

    async def hang(*_: object) -> object:
        await asyncio.sleep(3600)
        raise AssertionError

    # Stand in a Redis window whose call never returns, then cancel the admit.
    class Stuck:
        timeout_s = 1.0
        try_acquire_all = staticmethod(hang)

        async def close(self) -> None:
            pass

    admission._redis = Stuck()  # type: ignore[assignment]
    task = asyncio.create_task(admission.admit(t, "m"))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert admission.in_flight(t.id) == 0
    assert admission._local.count("modeldock:rl:{acme}:all") == 0


async def test_prometheus_counters_on_a_given_registry() -> None:
    registry = CollectorRegistry()
    t = tenant(rpm=1)
    admission = Admission(config(t), FakeClock(), registry=registry)
    ticket = await admission.admit(t, "m")
    with pytest.raises(RateLimited):
        await admission.admit(t, "m")
    value = registry.get_sample_value
    assert value("modeldock_admission_in_flight") == 1  # the rejected request holds nothing
    ticket.release()
    assert value("modeldock_admission_in_flight") == 0
    assert value("modeldock_admission_decisions_total", {"outcome": "admitted"}) == 1
    assert value("modeldock_admission_decisions_total", {"outcome": "rate_limited"}) == 1
    assert value("modeldock_admission_decisions_total", {"outcome": "unavailable"}) == 0
    assert value("modeldock_admission_redis_errors_total") == 0
    assert value("modeldock_admission_fail_open_total") == 0
    # A second Admission on its own registry does not collide (no global registry).
    Admission(config(t), FakeClock(), registry=CollectorRegistry())
