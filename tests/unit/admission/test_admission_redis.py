"""Admission against a real Redis/Valkey server started by tests.support.redis_server."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis.asyncio

from modeldock.admission.limits import Admission
from modeldock.admission.redis_window import RedisWindow
from modeldock.clock import FakeClock, SystemClock
from modeldock.errors import RateLimited, Unavailable
from modeldock.redis_client import make_redis_client
from tests.support.redis_server import RedisServer
from tests.unit.admission.admission_helpers import config, tenant


async def admit_all(admission: Admission, t: object, count: int) -> list[object]:
    return await asyncio.gather(*(admission.admit(t, "m") for _ in range(count)), return_exceptions=True)  # type: ignore[arg-type]


async def test_two_replicas_admit_exactly_the_limit(redis_server: RedisServer) -> None:
    t = tenant(rpm=25, max_in_flight=0)
    cfg = config(t, redis_url=redis_server.url, redis_timeout_ms=3000)
    # Replica clocks far apart: the shared window uses the Redis server's clock.
    replicas = [Admission(cfg, FakeClock(start=1000.0)), Admission(cfg, FakeClock(start=99_000.0))]
    try:
        results = await asyncio.gather(*(admit_all(r, t, 150) for r in replicas))
        flat = [item for per_replica in results for item in per_replica]
        admitted = [r for r in flat if not isinstance(r, BaseException)]
        rejected = [r for r in flat if isinstance(r, RateLimited)]
        assert len(admitted) == 25
        assert len(rejected) == 275
        assert all(r.code == "rate_limit_exceeded" and int(r.headers["Retry-After"]) >= 1 for r in rejected)
        # Local windows hold only what Redis admitted: rejected slots were given back.
        key = "modeldock:rl:{acme}:all"
        assert sum(r._local.count(key) for r in replicas) == 25
        assert sum(r.metrics.decisions["admitted"] for r in replicas) == 25
        assert sum(r.metrics.redis_errors for r in replicas) == 0
    finally:
        for r in replicas:
            await r.close()


async def test_redis_rejects_what_a_fresh_replica_would_admit(redis_server: RedisServer) -> None:
    t = tenant(rpm=3, max_in_flight=10)
    cfg = config(t, redis_url=redis_server.url, redis_timeout_ms=1000)
    a, b = Admission(cfg, FakeClock()), Admission(cfg, FakeClock())
    try:
        for _ in range(3):
            await a.admit(t, "m")
        with pytest.raises(RateLimited) as caught:
            await b.admit(t, "m")
        headers = caught.value.headers
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-limit-requests"] == "3"
        assert 59 <= int(headers["Retry-After"]) <= 60
        assert b._local.count("modeldock:rl:{acme}:all") == 0
        assert b.in_flight(t.id) == 0
    finally:
        await a.close()
        await b.close()


async def test_per_model_and_tenant_limits_are_checked_together(redis_server: RedisServer) -> None:
    t = tenant(rpm=5, per_model={"big": 2})
    cfg = config(t, redis_url=redis_server.url, redis_timeout_ms=1000)
    a, b = Admission(cfg, FakeClock()), Admission(cfg, FakeClock())
    try:
        await a.admit(t, "big")
        ticket = await b.admit(t, "big")
        assert ticket.headers["x-ratelimit-limit-requests"] == "2"
        with pytest.raises(RateLimited):
            await a.admit(t, "big")
        # The rejected "big" request took no tenant slot: 3 of 5 are left.
        for _ in range(3):
            await b.admit(t, "small")
        with pytest.raises(RateLimited):
            await a.admit(t, "small")

        client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
        try:
            keys = sorted(await client.keys("modeldock:*"))
            assert keys == ["modeldock:rl:{acme}:all", "modeldock:rl:{acme}:model:big"]
            assert await client.zcard("modeldock:rl:{acme}:all") == 5
            assert await client.zcard("modeldock:rl:{acme}:model:big") == 2
            assert 0 < await client.pttl("modeldock:rl:{acme}:all") <= 60_001
        finally:
            await client.aclose()
    finally:
        await a.close()
        await b.close()


async def test_sliding_across_the_window_edge(redis_server: RedisServer) -> None:
    window = RedisWindow(lambda: make_redis_client(redis_server.url, 1.0), timeout_s=1.0, window_seconds=1.0)
    try:
        start = time.monotonic()
        assert (await window.try_acquire("k", 3)).allowed
        assert (await window.try_acquire("k", 3)).allowed
        await asyncio.sleep(0.5)
        assert (await window.try_acquire("k", 3)).allowed
        rejected = await window.try_acquire("k", 3)
        assert not rejected.allowed
        assert 0.3 < rejected.retry_after_s <= 0.5
        # Past the first two admissions' expiry, but not the third's: exactly two slots came back.
        await asyncio.sleep(max(0.0, 1.1 - (time.monotonic() - start)))
        assert (await window.try_acquire("k", 3)).allowed
        last = await window.try_acquire("k", 3)
        assert last.allowed and last.remaining == 0
        assert not (await window.try_acquire("k", 3)).allowed
    finally:
        await window.close()


async def test_sliding_window_through_admission_in_real_time(redis_server: RedisServer) -> None:
    t = tenant(rpm=2)
    cfg = config(t, redis_url=redis_server.url, redis_timeout_ms=1000)
    admission = Admission(cfg, SystemClock(), window_seconds=0.5)
    try:
        await admission.admit(t, "m")
        await admission.admit(t, "m")
        with pytest.raises(RateLimited) as caught:
            await admission.admit(t, "m")
        assert caught.value.headers["Retry-After"] == "1"  # never less than 1
        await asyncio.sleep(0.55)
        await admission.admit(t, "m")
    finally:
        await admission.close()


async def test_redis_down_fails_closed_then_recovers(redis_server: RedisServer) -> None:
    t = tenant(rpm=100, max_in_flight=5)
    admission = Admission(config(t, redis_url=redis_server.url, redis_timeout_ms=500), FakeClock())
    try:
        await admission.admit(t, "m")
        redis_server.stop()
        with pytest.raises(Unavailable) as caught:
            await admission.admit(t, "m")
        assert caught.value.status == 503
        assert caught.value.code == "rate_limiter_unavailable"
        assert admission.in_flight(t.id) == 1  # only the first ticket
        assert admission._local.count("modeldock:rl:{acme}:all") == 1
        assert admission.metrics.redis_errors == 1
        assert admission.metrics.decisions["unavailable"] == 1

        redis_server.start()  # same port, empty
        ticket = await admission.admit(t, "m")
        assert ticket.headers["x-ratelimit-remaining-requests"] == "99"  # Redis lost its state
    finally:
        await admission.close()


async def test_restart_between_calls_reconnects_on_the_next_call(redis_server: RedisServer) -> None:
    t = tenant(rpm=100)
    admission = Admission(config(t, redis_url=redis_server.url, redis_timeout_ms=500), FakeClock())
    try:
        await admission.admit(t, "m")
        redis_server.start()  # kill and restart; the pooled connection is now dead
        await admission.admit(t, "m")
        assert admission.metrics.redis_errors == 0
    finally:
        await admission.close()


async def test_redis_down_fails_open_counts_and_logs_once(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    t = tenant(rpm=3)
    cfg = config(t, redis_url=redis_server.url, redis_timeout_ms=500, redis_fail_open=True)
    admission = Admission(cfg, clock)
    try:
        redis_server.stop()
        with caplog.at_level(logging.WARNING, logger="modeldock.admission.limits"):
            for _ in range(3):
                ticket = await admission.admit(t, "m")
            # The local window still guards this replica while Redis is away.
            with pytest.raises(RateLimited):
                await admission.admit(t, "m")
        assert ticket.headers["x-ratelimit-remaining-requests"] == "0"
        assert admission.metrics.fail_open_passes == 3
        assert admission.metrics.redis_errors == 3
        assert len([r for r in caplog.records if "redis_fail_open" in r.getMessage()]) == 1

        redis_server.start()
        clock.advance(60)
        await admission.admit(t, "m")
        assert admission.metrics.fail_open_passes == 3
    finally:
        await admission.close()


@pytest.mark.parametrize("fail_open", [False, True])
async def test_hung_redis_is_bounded_by_the_timeout(redis_server: RedisServer, fail_open: bool) -> None:
    t = tenant(rpm=100, max_in_flight=50)
    cfg = config(t, redis_url=redis_server.url, redis_timeout_ms=100, redis_fail_open=fail_open)
    admission = Admission(cfg, FakeClock())
    try:
        await admission.admit(t, "m")  # connected before the hang
        redis_server.pause()
        started = time.monotonic()
        results = await admit_all(admission, t, 20)
        elapsed = time.monotonic() - started
        assert elapsed < 1.0
        if fail_open:
            assert not any(isinstance(r, BaseException) for r in results)
        else:
            assert all(isinstance(r, Unavailable) for r in results)
            assert admission.in_flight(t.id) == 1
        redis_server.resume()
        await admission.admit(t, "m")  # recovers without a restart
    finally:
        redis_server.resume()
        await admission.close()


async def test_reconfigure_moves_to_a_new_redis(redis_server: RedisServer) -> None:
    t = tenant(rpm=2)
    with RedisServer() as other:
        admission = Admission(config(t, redis_url=redis_server.url, redis_timeout_ms=200), FakeClock())
        b = Admission(config(t, redis_url=other.url, redis_timeout_ms=200), FakeClock())
        try:
            await b.admit(t, "m")
            await b.admit(t, "m")  # the other Redis is full for this tenant
            await admission.admit(t, "m")
            admission.reconfigure(config(t, redis_url=other.url, redis_timeout_ms=200))
            with pytest.raises(RateLimited):
                await admission.admit(t, "m")
            # Same Redis settings: nothing is replaced.
            current = admission._redis
            admission.reconfigure(config(t, redis_url=other.url, redis_timeout_ms=200, redis_fail_open=True))
            assert admission._redis is current
            # Redis switched off: local windows only.
            admission.reconfigure(config(t))
            await admission.admit(t, "m")
        finally:
            await admission.close()
            await b.close()
        assert not admission._retired and not admission._retiring


def test_helper_restarts_on_the_same_port_and_cleans_up() -> None:
    server = RedisServer()
    try:
        server.start()
        port, pid, data_dir = server.port, server.pid, server.dir
        server.start()
        assert server.port == port and server.pid != pid and server.running
        server.stop()
        assert not server.running
    finally:
        server.close()
    assert not data_dir.exists()
