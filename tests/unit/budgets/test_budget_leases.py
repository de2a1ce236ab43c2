"""Token leases against a real Redis/Valkey: requests drawn from a block reserved in Redis, with an injected
clock and timers (tests.support.manual_timers fires the lease and flush timers by hand)."""

from __future__ import annotations

import asyncio
from typing import Protocol

import pytest
import redis.asyncio

from modeldock.budgets.budgets import Reservation, TokenBudgets
from modeldock.budgets.redis_window import RedisTokenWindow
from modeldock.budgets.tokens import Usage
from modeldock.clock import FakeClock
from modeldock.config import ConfigError, parse_config
from modeldock.errors import RateLimited, Unavailable
from modeldock.redis_client import make_batch_client
from tests.support.manual_timers import ManualTimers
from tests.support.redis_server import RedisServer
from tests.unit.budgets.budget_helpers import MINUTE, budget_config, budget_tenant, redis_total
from tests.unit.budgets.conftest import Replicas

REMAINING = "x-ratelimit-remaining-tokens"
BIG = 1_000_000


class Leased(Protocol):
    def __call__(
        self, tpm: int = BIG, *, lease_ms: int = 1000, fail_open: bool = False, timeout_ms: int = 2000
    ) -> TokenBudgets: ...


@pytest.fixture
def leased(replicas: Replicas, timers: ManualTimers) -> Leased:
    """Replicas with leases (the default lifetime unless `lease_ms`), their timers fired by hand."""

    def make(tpm: int = BIG, *, lease_ms: int = 1000, fail_open: bool = False, timeout_ms: int = 2000) -> TokenBudgets:
        return replicas(tpm, lease_ms=lease_ms, fail_open=fail_open, timeout_ms=timeout_ms, timers=timers)

    return make


def settle(reservation: Reservation, amount: int) -> None:
    """Settle without waiting: a Redis write waits for the next flush (the flush timer is fired by hand)."""
    reservation.finish_nowait(reached_backend=True, usage=Usage(prompt_tokens=amount, completion_tokens=0))


def trips(budgets: TokenBudgets) -> int:
    assert budgets._redis is not None
    return budgets._redis.batch.round_trips


async def test_requests_drawn_from_a_lease_make_no_redis_call(
    redis_server: RedisServer, clock: FakeClock, leased: Leased,
) -> None:
    t = budget_tenant(tpm=BIG)
    budgets = leased()
    first = await budgets.reserve(t, "m", 100, "r0")  # a miss: one round trip grants 2 x the recent draw
    assert trips(budgets) == 1 and await redis_total(redis_server) == 200
    # Remaining: Redis's after the grant (BIG - 200) + what the lease still holds (100).
    assert first.headers[REMAINING] == str(BIG - 100)
    second = await budgets.reserve(t, "m", 100, "r1")
    assert trips(budgets) == 1 and budgets._leases.draws == 1
    assert second.headers[REMAINING] == str(BIG - 200)
    await budgets.flush()  # the lease ran out: a top-up was started in the background
    assert budgets._leases.top_ups == 1 and budgets._leases.held() == 400
    # Steady traffic (200 requests a second for 2 s, each settled below its estimate) never misses:
    # the next lease is granted before the active one runs out or expires.
    for n in range(400):
        before = trips(budgets)
        r = await budgets.reserve(t, "m", 50, f"s{n}")
        assert trips(budgets) == before, n  # never a Redis call on the request path
        r.finish_nowait(reached_backend=True, usage=Usage(prompt_tokens=15, completion_tokens=5))
        clock.advance(0.005)
        await budgets.flush()  # a top-up started meanwhile lands (in service: about one round trip later)
    assert budgets.decisions["admitted"] - budgets._leases.draws == 1  # only the very first missed
    assert budgets._leases.top_ups <= 12 and trips(budgets) <= 2 * budgets._leases.top_ups + 1
    await budgets.close()
    assert await redis_total(redis_server) == 200 + 400 * 20  # close: every lease settled to its draws


async def test_reserve_up_to_grants_the_room_and_a_resent_call_returns_the_same_grant(
    redis_server: RedisServer,
) -> None:
    window = RedisTokenWindow(lambda: make_batch_client(redis_server.url, 1.0), timeout_s=1.0)
    day = "modeldock:tb:{acme}:day"
    limits = [(MINUTE, 1000, 60.0), (day, 300, 86400.0)]
    keys = [(k, w) for k, _, w in limits]
    try:
        decisions, grant = await window.reserve_up_to("L1", 10, 500, limits)
        assert grant == 300 and [d.remaining for d in decisions] == [700, 0]  # the day window's room
        again, grant_again = await window.reserve_up_to("L1", 10, 500, limits)  # a resent write
        assert grant_again == 300 and again[0].allowed and await redis_total(redis_server) == 300
        refused, none = await window.reserve_up_to("L2", 10, 500, limits)
        assert none == 0 and not refused[1].allowed and refused[1].retry_after_s > 0
        assert await window.settle("L1", keys, 120) == 2
        _, exact = await window.reserve_up_to("L3", 10, 500, limits)
        assert exact == 180  # exactly what the day window has left
        _, one = await window.reserve_up_to("L4", 0, 0, [(MINUTE, 1000, 60.0)])
        assert one == 0  # want = cost = 0: the plain one-request shape
        assert await redis_total(redis_server, day) == 300
        assert await redis_total(redis_server) == 300
    finally:
        await window.close()


async def test_a_miss_near_the_limit_takes_exactly_the_room_and_refunds_are_room_again(
    redis_server: RedisServer, leased: Leased,
) -> None:
    t = budget_tenant(tpm=1600)
    other = leased(1600, lease_ms=0)
    budgets = leased(1600)
    await other.reserve(t, "m", 1550, "big")
    r1 = await budgets.reserve(t, "m", 30, "a")  # wants 60, 50 fit
    assert await redis_total(redis_server) == 1600 and budgets._leases.held() == 20
    assert r1.headers[REMAINING] == "20"
    n = trips(budgets)
    r2 = await budgets.reserve(t, "m", 20, "b")
    assert trips(budgets) == n and r2.headers[REMAINING] == "0"
    await budgets.flush()  # its top-up: refused (no room), the lease serves on
    assert budgets._leases.top_ups == 1 and budgets._leases.grants == 1
    n = trips(budgets)
    with pytest.raises(RateLimited) as caught:
        await budgets.reserve(t, "m", 1, "c")  # a miss: Redis refuses, as without leases
    assert caught.value.headers["Retry-After"] == "60"
    settle(r1, 10)  # 20 below the estimate: room in the lease again, no Redis write
    await budgets.flush()
    assert trips(budgets) == n + 1 and await redis_total(redis_server) == 1600
    r3 = await budgets.reserve(t, "m", 15, "d")
    assert trips(budgets) == n + 1 and r3.headers[REMAINING] == "5"
    await budgets.close()
    await other.close()
    assert await redis_total(redis_server) == 1550 + 10 + 20 + 15


async def test_usage_above_the_estimate_raises_the_entry_at_once_and_retirement_frees_the_rest(
    redis_server: RedisServer, timers: ManualTimers, leased: Leased,
) -> None:
    t = budget_tenant(tpm=BIG)
    budgets = leased()
    r1 = await budgets.reserve(t, "m", 100, "a")  # lease of 200, 100 drawn
    settle(r1, 250)  # drawn 250 > the entry's 200: the entry follows
    await budgets.flush()
    assert await redis_total(redis_server) == 250 and budgets._leases.held() == 0
    r2 = await budgets.reserve(t, "m", 40, "b")  # a miss: a new lease (the old one retires)
    r3 = await budgets.reserve(t, "m", 30, "c")
    await budgets.flush()
    assert budgets._leases.held() > 0
    assert await redis_total(redis_server) == 250 + 40 + 30 + budgets._leases.held()
    assert timers.fire() >= 1  # the lease timer: the active lease retires
    await budgets.flush()
    assert budgets._leases.held() == 0
    assert await redis_total(redis_server) == 250 + 40 + 30  # only what was drawn is held
    settle(r2, 5)
    settle(r3, 70)
    await budgets.flush()
    assert await redis_total(redis_server) == 250 + 5 + 70  # retired: the entries follow each settlement


async def test_an_idle_lease_is_retired_by_its_timer_and_an_expired_one_is_not_drawn_from(
    redis_server: RedisServer, clock: FakeClock, timers: ManualTimers, leased: Leased,
) -> None:
    t = budget_tenant(tpm=BIG)
    budgets = leased()
    r1 = await budgets.reserve(t, "m", 100, "a")
    assert 1.0 in timers.armed and budgets._leases.held() == 100
    clock.advance(1.0)
    timers.fire()
    await budgets.flush()
    assert budgets._leases.held() == 0 and not budgets._leases._sets  # idle: its rate forgotten too
    assert await redis_total(redis_server) == 100
    r1.finish_nowait(reached_backend=False, usage=None)
    await budgets.flush()
    assert await redis_total(redis_server) == 0
    await budgets.reserve(t, "m", 100, "b")
    clock.advance(1.0)  # expired, its timer not yet run: the next request does not draw from it
    n = trips(budgets)
    await budgets.reserve(t, "m", 100, "c")
    assert trips(budgets) == n + 1 and budgets._leases.draws == 0
    await budgets.close()
    assert await redis_total(redis_server) == 200


async def test_an_expired_lease_is_not_drawn_from_while_redis_is_down(
    redis_server: RedisServer, clock: FakeClock, leased: Leased,
) -> None:
    t = budget_tenant(tpm=BIG)
    budgets = leased(timeout_ms=1000)
    await budgets.reserve(t, "m", 100, "a")  # a lease of 200
    redis_server.stop()
    clock.advance(1.0)
    with pytest.raises(Unavailable) as caught:
        await budgets.reserve(t, "m", 10, "c")  # expired: the exact path, and its failure rule
    assert caught.value.code == "rate_limiter_unavailable" and budgets.held("c") is None
    assert budgets.redis_errors == 1 and budgets._local.used(MINUTE, 60.0) == 100


async def test_a_lease_serves_while_redis_is_down_until_its_top_up_fails(
    redis_server: RedisServer, leased: Leased,
) -> None:
    t = budget_tenant(tpm=BIG)
    budgets = leased(timeout_ms=1000)
    await budgets.reserve(t, "m", 100, "a")  # a lease of 200
    redis_server.stop()
    await budgets.reserve(t, "m", 50, "b")  # drawn, no Redis involved; its top-up starts
    assert budgets.redis_errors == 0 and budgets._leases.top_ups == 1
    await budgets._leases.wait()
    assert budgets.redis_errors == 1 and budgets._leases.held() == 0  # the failed top-up dropped it
    with pytest.raises(Unavailable):
        await budgets.reserve(t, "m", 10, "c")
    assert budgets.decisions["unavailable"] == 1


async def test_fail_open_admits_on_the_local_windows_when_a_miss_fails(
    redis_server: RedisServer, leased: Leased,
) -> None:
    t = budget_tenant(tpm=300)
    budgets = leased(300, fail_open=True, timeout_ms=1000)
    redis_server.stop()
    r = await budgets.reserve(t, "m", 200, "a")
    assert budgets.fail_open_passes == 1 and budgets._leases.held() == 0
    with pytest.raises(RateLimited):
        await budgets.reserve(t, "m", 200, "b")  # the local window still limits this replica
    await r.settle(50)
    assert budgets.settle_errors == 0


async def test_close_and_reconfigure_leave_nothing_held(redis_server: RedisServer, leased: Leased) -> None:
    t = budget_tenant(tpm=BIG)
    budgets = leased()
    held = [await budgets.reserve(t, "m", 100, f"r{i}") for i in range(3)]
    await budgets.flush()
    budgets.reconfigure(budget_config(t, redis_url=redis_server.url, redis_timeout_ms=2000))
    await budgets.flush()
    assert budgets._leases.held() == 0 and await redis_total(redis_server) == 300
    # A grant in flight during a reconfigure is retired when it lands: the request keeps its tokens.
    task = asyncio.ensure_future(budgets.reserve(t, "m", 100, "late"))
    await asyncio.sleep(0)
    budgets.reconfigure(budget_config(t, redis_url=redis_server.url, redis_timeout_ms=2000))
    late = await task
    await budgets.flush()
    assert budgets._leases.held() == 0 and await redis_total(redis_server) == 400
    held.append(late)
    drawn = [await budgets.reserve(t, "m", 100, f"d{i}") for i in range(3)]
    settle(held[0], 30)
    settle(drawn[0], 160)
    await budgets.close()
    assert await redis_total(redis_server) == 30 + 300 + 160 + 200  # settled at usage, held at their estimate
    for r in [*held[1:], *drawn[1:]]:
        await r.settle(1)  # after close: still written, to the Redis that holds the lease
    assert await redis_total(redis_server) == 30 + 160 + 5


async def test_without_leases_each_request_is_its_own_entry(
    redis_server: RedisServer, timers: ManualTimers, leased: Leased,
) -> None:
    t = budget_tenant(tpm=BIG)
    budgets = leased(lease_ms=0)
    client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        r1 = await budgets.reserve(t, "m", 100, "a")
        r2 = await budgets.reserve(t, "m", 100, "b")
        assert trips(budgets) == 2 and r2.headers[REMAINING] == str(BIG - 200) and not timers.armed
        assert set(await client.hkeys(MINUTE + ":amt")) == {"~total", r1._entry_id, r2._entry_id}
        settle(r1, 40)
        await budgets.flush()
        assert await redis_total(redis_server) == 140
    finally:
        await client.aclose()


async def test_a_burst_of_misses_takes_one_lease(redis_server: RedisServer, leased: Leased) -> None:
    t = budget_tenant(tpm=BIG)
    budgets = leased()
    burst: list[Reservation] = await asyncio.gather(*(budgets.reserve(t, "m", 100, f"r{i}") for i in range(16)))
    assert len(burst) == 16 and budgets._leases.grants == 16
    # The first asked for a lease (2 x the draw it had seen: 200); the others, in flight meanwhile,
    # for their own cost.
    assert budgets._leases.held() == 100 and await redis_total(redis_server) == 1700
    await budgets.close()
    assert await redis_total(redis_server) == 1600


@pytest.mark.parametrize(("value", "reason"), [(-1, "greater than or equal to 0"), (10_001, "less than or equal")])


def test_the_lease_lifetime_is_validated_and_named(value: int, reason: str) -> None:
    data = {"models": [{"name": "m", "endpoints": ["127.0.0.1:8000"]}], "limits": {"token_lease_ms": value}}
    with pytest.raises(ConfigError) as info:
        parse_config(data, "gw.yaml")
    assert "gw.yaml: limits.token_lease_ms: " in str(info.value) and reason in str(info.value)
    assert parse_config({**data, "limits": {}}).limits.token_lease_ms == 1000
