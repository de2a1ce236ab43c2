"""Token budgets against a real Redis/Valkey (tests.support.redis_server), with an injected clock. Budgets
here are small: most requests exceed a lease (1/16 of the budget)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from modeldock.budgets.budgets import Reservation
from modeldock.budgets.redis_window import RedisTokenWindow
from modeldock.clock import FakeClock
from modeldock.errors import RateLimited, Unavailable
from modeldock.redis_client import make_redis_client
from tests.support.redis_server import RedisServer
from tests.unit.budgets.budget_helpers import MINUTE, budget_config, budget_tenant, redis_total
from tests.unit.budgets.conftest import Replicas


@pytest.mark.parametrize("lease_ms", [0, 1000])
async def test_two_replicas_share_one_budget(redis_server: RedisServer, replicas: Replicas, lease_ms: int) -> None:
    t = budget_tenant(tpm=10_000)
    a, b = (replicas(10_000, lease_ms=lease_ms) for _ in range(2))
    rng = random.Random(7)
    costs = [rng.randint(50, 900) for _ in range(120)]
    results = await asyncio.gather(
        *((a if i % 2 else b).reserve(t, "m", cost, f"r{i}") for i, cost in enumerate(costs)),
        return_exceptions=True,
    )
    admitted = [costs[i] for i, r in enumerate(results) if not isinstance(r, BaseException)]
    assert all(isinstance(r, RateLimited) for r in results if isinstance(r, BaseException))
    # With leases, each replica's active lease may hold undrawn room (at most 1/16 of the budget).
    undrawn = a._leases.held() + b._leases.held()
    assert undrawn <= 2 * 10_000 // 16 and (undrawn == 0 or lease_ms)
    assert sum(admitted) + undrawn <= 10_000 and sum(admitted) + undrawn > 10_000 - 900
    await a.flush()
    await b.flush()
    assert await redis_total(redis_server) == sum(admitted) + undrawn
    # Settling higher than reserved overshoots the budget by at most what those requests underestimated.
    held = [r for r in results if isinstance(r, Reservation)]
    for r in held:
        await r.settle(r.cost + 10)
    a._leases.retire_all()  # a retired lease's entry is what was drawn from it
    b._leases.retire_all()
    await a.flush()
    await b.flush()
    total = await redis_total(redis_server)
    assert total == sum(admitted) + 10 * len(held)
    left = max(10_000 - total, 0)
    with pytest.raises(RateLimited) as caught:
        await a.reserve(t, "m", left + 1, "late")
    assert caught.value.headers["x-ratelimit-remaining-tokens"] == str(left)


async def test_settle_refund_and_window_edge_in_redis(
    redis_server: RedisServer, clock: FakeClock, replicas: Replicas,
) -> None:
    t = budget_tenant(tpm=1000)
    a, b = replicas(1000), replicas(1000)
    r1 = await a.reserve(t, "m", 600, "x")
    clock.advance(20)
    r2 = await b.reserve(t, "m", 300, "y")
    assert r2.headers["x-ratelimit-remaining-tokens"] == "100"
    with pytest.raises(RateLimited) as caught:
        await b.reserve(t, "m", 200, "z")
    assert caught.value.headers["Retry-After"] == "40"  # when r1's 600 leaves the window
    await r1.finish(reached_backend=True, usage=None)  # unknown usage: charged its reservation
    await r2.finish(reached_backend=False, usage=None)  # refunded
    await r2.settle(999)  # no-op
    assert await redis_total(redis_server) == 600
    clock.advance(39.999)
    with pytest.raises(RateLimited):
        await b.reserve(t, "m", 401, "z2")
    clock.advance(0.001)  # exactly one window after r1
    r3 = await b.reserve(t, "m", 1000, "z3")
    assert r3.headers["x-ratelimit-remaining-tokens"] == "0"


async def test_a_resent_reserve_or_settle_counts_once(redis_server: RedisServer) -> None:
    window = RedisTokenWindow(lambda: make_redis_client(redis_server.url, 1.0), timeout_s=1.0)
    limits = [(MINUTE, 100, 60.0), ("modeldock:tb:{acme}:day", 1000, 86400.0)]
    try:
        first, _ = await window.reserve_up_to("id-1", 70, 70, limits)  # one request's shape: want = cost
        assert first[0].allowed
        again, _ = await window.reserve_up_to("id-1", 70, 70, limits)  # e.g. redis-py's retry after a reset
        assert again[0].allowed and again[0].remaining == 30
        assert await redis_total(redis_server) == 70
        keys = [(k, w) for k, _, w in limits]
        assert await window.settle("id-1", keys, 20) == 2
        assert await window.settle("id-1", keys, 20) == 2
        assert await redis_total(redis_server) == 20
        assert await redis_total(redis_server, "modeldock:tb:{acme}:day") == 20
        assert await window.settle("id-1", keys, 0) == 2
        assert await window.settle("id-1", keys, 5) == 0  # refunded: gone
        assert await redis_total(redis_server) == 0
    finally:
        await window.close()


async def test_redis_down_fails_closed_then_recovers(redis_server: RedisServer, replicas: Replicas) -> None:
    t = budget_tenant(tpm=1000)
    budgets = replicas(1000, timeout_ms=1000)
    redis_server.stop()
    with pytest.raises(Unavailable) as caught:
        await budgets.reserve(t, "m", 100, "a")
    assert caught.value.status == 503 and caught.value.code == "rate_limiter_unavailable"
    assert caught.value.headers["Retry-After"] == "1"
    assert budgets.held("a") is None and budgets._local.used(MINUTE, 60.0) == 0
    redis_server.start()
    r = await budgets.reserve(t, "m", 100, "a")
    assert r.headers["x-ratelimit-remaining-tokens"] == "900"
    assert budgets.redis_errors == 1 and budgets.decisions["unavailable"] == 1


async def test_redis_down_fails_open_on_local_budgets(redis_server: RedisServer, replicas: Replicas) -> None:
    t = budget_tenant(tpm=300)
    budgets = replicas(300, timeout_ms=1000, fail_open=True)
    redis_server.stop()
    r = await budgets.reserve(t, "m", 200, "a")
    assert budgets.fail_open_passes == 1
    with pytest.raises(RateLimited):  # the local window still limits this replica
        await budgets.reserve(t, "m", 200, "b")
    await r.settle(50)  # held only locally: no Redis call, no error
    assert budgets.settle_errors == 0 and budgets._local.used(MINUTE, 60.0) == 50


async def test_a_hung_redis_is_bounded_and_a_failed_settle_keeps_the_charge(
    redis_server: RedisServer, replicas: Replicas,
) -> None:
    t = budget_tenant(tpm=1000)
    budgets = replicas(1000, timeout_ms=200)
    r = await budgets.reserve(t, "m", 400, "a")
    redis_server.pause()
    started = time.monotonic()
    await r.settle(10)
    assert time.monotonic() - started < 1.0
    assert budgets.settle_errors == 1 and r.state == "settled"
    with pytest.raises(Unavailable):
        await budgets.reserve(t, "m", 1, "b")
    redis_server.resume()
    # Redis reads the timed-out settlement when it wakes, and may still apply it; one it never
    # takes leaves the reservation (test_budgets_redis_batch: the reservations stand).
    assert await redis_total(redis_server) in (400, 10)


async def test_cancelled_reserve_is_refunded_in_redis(redis_server: RedisServer, replicas: Replicas) -> None:
    t = budget_tenant(tpm=1000)
    budgets = replicas(1000, timeout_ms=2000)
    redis_server.pause()
    task = asyncio.ensure_future(budgets.reserve(t, "m", 300, "a"))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert budgets._local.used(MINUTE, 60.0) == 0 and budgets.held("a") is None
    redis_server.resume()
    await budgets.flush()  # the queued refund goes once Redis answers
    assert await redis_total(redis_server) == 0


async def test_reconfigure_to_another_redis_settles_where_it_reserved(
    redis_server: RedisServer, replicas: Replicas,
) -> None:
    t = budget_tenant(tpm=1000)
    budgets = replicas(1000)
    other = RedisServer().start()
    try:
        r = await budgets.reserve(t, "m", 500, "a")
        budgets.reconfigure(budget_config(t, redis_url=other.url, redis_timeout_ms=2000))
        fresh = await budgets.reserve(t, "m", 400, "b")  # the new Redis is empty; the local window is not
        assert fresh.headers["x-ratelimit-remaining-tokens"] == "600"
        await r.settle(100)  # settles in the Redis that holds it
        assert await redis_total(redis_server) == 100
        assert await redis_total(other) == 400
    finally:
        other.close()


async def test_a_settle_whose_caller_is_cancelled_still_lands(redis_server: RedisServer, replicas: Replicas) -> None:
    t = budget_tenant(tpm=1000)
    budgets = replicas(1000)
    r = await budgets.reserve(t, "m", 500, "a")
    redis_server.pause()
    caller = asyncio.ensure_future(r.settle(50))
    await asyncio.sleep(0.05)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    redis_server.resume()
    await budgets.flush()
    assert await redis_total(redis_server) == 50 and r.charged == 50
