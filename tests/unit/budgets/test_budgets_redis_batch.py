"""Token budgets in Redis: settlements queued and flushed in batches (flush timer fired by hand)."""

from __future__ import annotations

import asyncio

import redis.asyncio

from modeldock.budgets.budgets import TokenBudgets
from modeldock.budgets.tokens import Usage
from modeldock.clock import FakeClock
from tests.support.manual_timers import ManualTimers
from tests.support.redis_server import RedisServer
from tests.unit.budgets.budget_helpers import MINUTE, budget_config, budget_tenant, clocked, redis_total


def replica(server: RedisServer, clock: FakeClock, timers: ManualTimers, *, timeout_ms: int = 2000) -> TokenBudgets:
    cfg = budget_config(budget_tenant(tpm=1000), redis_url=server.url, redis_timeout_ms=timeout_ms)
    return TokenBudgets(cfg, clock, redis_now_us=clocked(clock), redis_call_later=timers.call_later)


def used(total: int) -> Usage:
    return Usage(prompt_tokens=total // 2, completion_tokens=total - total // 2)


async def test_a_settlement_waits_for_the_flush_or_goes_with_the_next_reserve(redis_server: RedisServer) -> None:
    clock, timers = FakeClock(), ManualTimers()
    t = budget_tenant(tpm=1000)
    budgets = replica(redis_server, clock, timers)
    try:
        r1 = await budgets.reserve(t, "m", 600, "a")
        r1.finish_nowait(reached_backend=True, usage=used(100))
        assert budgets._local.used(MINUTE, 60.0) == 100  # the local window changes at once
        assert await redis_total(redis_server) == 600 and timers.armed  # Redis: queued for the flush
        r2 = await budgets.reserve(t, "m", 300, "b")  # the queued settlement goes first, in the same trip
        assert r2.headers["x-ratelimit-remaining-tokens"] == "600"
        assert await redis_total(redis_server) == 400
        r2.finish_nowait(reached_backend=False, usage=None)
        assert await redis_total(redis_server) == 400
        timers.fire()
        await budgets.flush()
        assert await redis_total(redis_server) == 100 and budgets.settle_errors == 0
    finally:
        await budgets.close()


async def test_a_failed_flush_counts_each_settlement_and_the_reservations_stand(redis_server: RedisServer) -> None:
    clock, timers = FakeClock(), ManualTimers()
    t = budget_tenant(tpm=1000)
    budgets = replica(redis_server, clock, timers, timeout_ms=200)
    try:
        held = [await budgets.reserve(t, "m", 200, f"r{i}") for i in range(3)]
        admin = redis.asyncio.Redis.from_url(redis_server.url)
        # Redis answers nothing for 600 ms, and drops the commands of a client that left meanwhile.
        await admin.execute_command("CLIENT", "PAUSE", 600, "ALL")
        await admin.aclose()
        settled = [r.finish_nowait(reached_backend=True, usage=used(10)) for r in held]
        timers.fire()
        await asyncio.gather(*(f for f in settled if f is not None))
        assert budgets.settle_errors == 3 and all(r.state == "settled" for r in held)
        assert await redis_total(redis_server) == 600  # (answered once the pause ends) each charged its reservation
    finally:
        await budgets.close()


async def test_close_flushes_settlements_to_the_redis_that_holds_them(redis_server: RedisServer) -> None:
    clock, timers = FakeClock(), ManualTimers()
    t = budget_tenant(tpm=1000)
    budgets = replica(redis_server, clock, timers)
    other = RedisServer().start()
    try:
        old = await budgets.reserve(t, "m", 500, "a")
        budgets.reconfigure(budget_config(t, redis_url=other.url, redis_timeout_ms=2000))
        new = await budgets.reserve(t, "m", 400, "b")
        old.finish_nowait(reached_backend=True, usage=used(50))
        new.finish_nowait(reached_backend=True, usage=used(40))
        await budgets.close()  # the flush timer never fired
        assert await redis_total(redis_server) == 50
        assert await redis_total(other) == 40
        assert budgets.settle_errors == 0
    finally:
        await budgets.close()
        other.close()
