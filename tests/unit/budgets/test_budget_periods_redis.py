"""Calendar and cost budgets on a real Redis/Valkey: two replicas (two TokenBudgets on one Redis) across
a month boundary on an injected clock, leases that never serve past their period, counters that keep
only live entries, and cost budgets reserved and settled in Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio

from modeldock.budgets.budgets import TokenBudgets
from modeldock.budgets.pricing import model_price
from modeldock.budgets.tokens import Usage
from modeldock.clock import FakeClock
from modeldock.config import PriceConfig, TenantConfig
from modeldock.errors import RateLimited
from tests.support.manual_timers import ManualTimers
from tests.support.redis_server import RedisServer
from tests.unit.budgets.budget_helpers import budget_config, budget_tenant, clocked, redis_total
from tests.unit.budgets.test_budget_periods import NY_NEW_YEAR

DEC = "modeldock:tb:{acme}:month:2026-12"
JAN = "modeldock:tb:{acme}:month:2027-01"


def replica(server: RedisServer, clock: FakeClock, timers: ManualTimers, t: TenantConfig, **limits: object
            ) -> TokenBudgets:
    cfg = budget_config(t, redis_url=server.url, redis_timeout_ms=2000, **limits)  # type: ignore[arg-type]
    return TokenBudgets(cfg, clock, redis_now_us=clocked(clock), redis_call_later=timers.call_later)


async def entries(server: RedisServer, key: str) -> int:
    client = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
    try:
        return int(await client.hlen(key + ":amt"))
    finally:
        await client.aclose()


async def test_two_replicas_share_a_month_that_resets_exactly_at_the_boundary(redis_server: RedisServer) -> None:
    t = budget_tenant(tokens_per_month=16_000, budget_timezone="America/New_York")  # leases up to 1,000
    clock, timers = FakeClock(wall=NY_NEW_YEAR - 0.5), ManualTimers()
    a, b = replica(redis_server, clock, timers, t), replica(redis_server, clock, timers, t)
    async with asyncio.timeout(10):
        try:
            a1 = await a.reserve(t, "m", "a1", prompt=100, output=0)  # a miss: a lease of 200 in December
            assert a._leases.held() == 100
            b1 = await b.reserve(t, "m", "b1", prompt=15_700, output=0)  # December: 100 left, in A's lease
            with pytest.raises(RateLimited) as caught:
                await b.reserve(t, "m", "b2", prompt=101, output=0)
            assert caught.value.headers["Retry-After"] == "1"  # 0.5 s to the boundary, rounded up
            clock.advance(0.5 - 0.001)  # 1 ms before the boundary
            a2 = await a.reserve(t, "m", "a2", prompt=100, output=0)  # from the December lease, no Redis call
            assert a._leases.draws == 1
            await a._leases.wait()  # its top-up takes December's last 100 as the next lease
            clock.advance(0.001)  # exactly at the boundary: both replicas count January
            jan = await a.reserve(t, "m", "a3", prompt=100, output=0)
            assert a._leases.draws == 1  # not drawn from a December lease, though one has room
            assert jan.headers["x-ratelimit-reset-tokens"] == "744h0m0s"  # January in New York: 31 x 24 h
            whole = await b.reserve(t, "m", "b3", prompt=16_000 - 200, output=0)  # all but A's January lease
            assert whole.headers["x-ratelimit-remaining-tokens"] == "0"
            with pytest.raises(RateLimited):
                await b.reserve(t, "m", "b4", prompt=1, output=0)
            # December's late settlement lands in December's counter only.
            a1.finish_nowait(sent=True, usage=Usage(40, 0))
            await a.flush()
            assert await redis_total(redis_server, DEC) == 15_700 + 140 + 100  # + the top-up lease
            assert await redis_total(redis_server, JAN) == 200 + 15_800
            a2.finish_nowait(sent=True, usage=Usage(100, 0))
            b1.finish_nowait(sent=True, usage=None)
        finally:
            await a.close()
            await b.close()
    # Closed: every lease retired, December's settled; its counter keeps only its total (no entry each).
    assert await redis_total(redis_server, DEC) == 15_700 + 140
    assert await entries(redis_server, DEC) == 1
    assert await redis_total(redis_server, JAN) == 100 + 15_800  # A's unused January lease given back


async def test_a_lease_granted_before_the_boundary_is_not_drawn_after_it(redis_server: RedisServer) -> None:
    t = budget_tenant(tokens_per_month=16_000, budget_timezone="America/New_York")
    clock, timers = FakeClock(wall=NY_NEW_YEAR - 0.2), ManualTimers()
    a = replica(redis_server, clock, timers, t)
    async with asyncio.timeout(10):
        try:
            await a.reserve(t, "m", "x", prompt=100, output=0)  # a December lease with 100 undrawn
            clock.advance(0.2)
            await a.reserve(t, "m", "y", prompt=50, output=0)  # January: a miss, not the December lease
            await a.flush()
            # December's lease still holds its grant until it retires (its timer or close): 100 + 100.
            assert await redis_total(redis_server, DEC) == 200
            timers.fire()  # the lease timers: December's retires, giving back its undrawn 100
            await a.flush()
            assert await redis_total(redis_server, DEC) == 100
        finally:
            await a.close()


async def test_a_cost_budget_in_redis_caps_and_settles_the_price(redis_server: RedisServer) -> None:
    price = PriceConfig(input=2.0, cached_input=0.5, output=8.0)
    t = budget_tenant(cost_per_month=0.01)
    clock, timers = FakeClock(), ManualTimers()
    cfg = budget_config(t, price=price, redis_url=redis_server.url, redis_timeout_ms=2000)
    a = TokenBudgets(cfg, clock, redis_now_us=clocked(clock), redis_call_later=timers.call_later)
    b = TokenBudgets(cfg, clock, redis_now_us=clocked(clock), redis_call_later=timers.call_later)
    key = "modeldock:tb:{acme}:cost:month:2023-11"
    async with asyncio.timeout(10):
        try:
            # 2,000 + 4,000 millionths
            r = await a.reserve(t, "m", "a", prompt=1000, output=500, price=model_price(cfg.models[0]))
            assert await redis_total(redis_server, key) == 6000
            r.finish_nowait(sent=True, usage=Usage(1000, 100, cached_tokens=1000))  # 500 + 800
            await a.flush()
            assert await redis_total(redis_server, key) == 1300
            # B sees A's settled spend: 8,700 left, a 1,000-token prompt leaves 837 output tokens (6,696).
            capped = await b.reserve(t, "m", "b", prompt=1000, output=2000, min_output=1,
                                     price=model_price(cfg.models[0]))
            assert (capped.output, capped.headers["x-ratelimit-binding-tokens"]) == (837, "cost_per_month")
            assert await redis_total(redis_server, key) == 1300 + 2000 + 837 * 8
            capped.refund_nowait()
            await b.flush()
            assert await redis_total(redis_server, key) == 1300
            assert await entries(redis_server, key) == 1  # settled entries folded into the total
        finally:
            await a.close()
            await b.close()
