"""Calendar budgets, output capping and cost budgets on local windows (no Redis), with a FakeClock.

Expected instants are written as UTC datetimes with the zone's known offset, not computed with zoneinfo.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from modeldock.budgets.budgets import TokenBudgets
from modeldock.budgets.period import period_at
from modeldock.budgets.pricing import model_price
from modeldock.budgets.tokens import Usage
from modeldock.clock import FakeClock
from modeldock.config import ConfigError, PriceConfig, parse_config
from modeldock.errors import RateLimited
from tests.unit.budgets.budget_helpers import budget_config, budget_tenant

HOUR = 3600.0
# 2027-01-01 00:00 in New York (EST, UTC-5) is 05:00Z.
NY_NEW_YEAR = datetime(2027, 1, 1, 5, tzinfo=UTC).timestamp()


def utc(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()


def test_a_month_starts_at_local_midnight_of_its_zone() -> None:
    before = period_at("month", NY_NEW_YEAR - 0.001, "America/New_York")
    at = period_at("month", NY_NEW_YEAR, "America/New_York")
    assert (before.label, before.end) == ("2026-12", NY_NEW_YEAR)
    assert (at.label, at.start) == ("2027-01", NY_NEW_YEAR)
    # December in New York starts at 05:00Z too (EST all month): 31 days of 24 h.
    assert before.start == utc(2026, 12, 1, 5)
    # In UTC the same instant is still 2027-01-01 (05:00Z), and December ended 5 h earlier.
    assert period_at("month", NY_NEW_YEAR - 0.001, "UTC").label == "2027-01"


def test_dst_days_are_23_and_25_hours_long() -> None:
    # Berlin: summer time from 2026-03-29 02:00 CET, back on 2026-10-25 03:00 CEST.
    spring = period_at("day", utc(2026, 3, 29, 12), "Europe/Berlin")
    autumn = period_at("day", utc(2026, 10, 25, 12), "Europe/Berlin")
    plain = period_at("day", utc(2026, 3, 30, 12), "Europe/Berlin")
    assert (spring.label, spring.start, spring.end) == ("2026-03-29", utc(2026, 3, 28, 23), utc(2026, 3, 29, 22))
    assert spring.end - spring.start == 23 * HOUR
    assert (autumn.start, autumn.end) == (utc(2026, 10, 24, 22), utc(2026, 10, 25, 23))
    assert autumn.end - autumn.start == 25 * HOUR
    assert plain.end - plain.start == 24 * HOUR


def test_a_midnight_inside_a_dst_gap_starts_the_day_at_the_gap_end() -> None:
    # Santiago: 2026-09-06 00:00 -04 jumps to 01:00 -03, i.e. the day starts at 04:00Z.
    day = period_at("day", utc(2026, 9, 6, 12), "America/Santiago")
    assert (day.label, day.start) == ("2026-09-06", utc(2026, 9, 6, 4))


async def test_a_monthly_budget_resets_exactly_at_the_boundary_in_its_zone() -> None:
    t = budget_tenant(tokens_per_month=1000, budget_timezone="America/New_York")
    clock = FakeClock(wall=NY_NEW_YEAR - 10.0)
    b = TokenBudgets(budget_config(t), clock)
    await b.reserve(t, "m", "a", prompt=600, output=0)
    clock.advance(10.0 - 0.001)  # 1 ms before the boundary: still December, 400 left
    last = await b.reserve(t, "m", "b", prompt=400, output=0)
    assert last.headers["x-ratelimit-remaining-tokens"] == "0"
    assert last.headers["x-ratelimit-reset-tokens"] == "1ms"
    assert last.headers["x-ratelimit-binding-tokens"] == "tokens_per_month"
    with pytest.raises(RateLimited) as caught:
        await b.reserve(t, "m", "c", prompt=1, output=0)
    assert caught.value.headers["Retry-After"] == "1"  # whole seconds, rounded up from 1 ms
    clock.advance(0.001)  # exactly at the boundary: January, the whole budget again
    jan = await b.reserve(t, "m", "d", prompt=1000, output=0)
    assert jan.headers["x-ratelimit-remaining-tokens"] == "0"
    # A December request settling in January changes December's counter, not January's.
    await last.finish(sent=True, usage=Usage(100, 0))
    with pytest.raises(RateLimited, match="per month"):
        await b.reserve(t, "m", "e", prompt=1, output=0)


async def test_the_day_budget_is_a_calendar_day_in_the_tenant_zone() -> None:
    # Tokyo (UTC+9): 2026-06-01 00:00 JST is 2026-05-31 15:00Z.
    boundary = utc(2026, 5, 31, 15)
    t = budget_tenant(tpd=100, budget_timezone="Asia/Tokyo")
    clock = FakeClock(wall=boundary - 60.0)
    b = TokenBudgets(budget_config(t, budget_timezone="Europe/Berlin"), clock)  # the tenant's zone wins
    await b.reserve(t, "m", "a", prompt=100, output=0)
    with pytest.raises(RateLimited) as caught:
        await b.reserve(t, "m", "b", prompt=1, output=0)
    assert caught.value.headers["Retry-After"] == "60"  # a sliding day would say 86400
    clock.advance(60.0)
    await b.reserve(t, "m", "c", prompt=100, output=0)


async def test_the_output_is_capped_to_what_every_budget_has_left() -> None:
    t = budget_tenant(tpm=1000, tokens_per_month=5000)
    b = TokenBudgets(budget_config(t), FakeClock())
    first = await b.reserve(t, "m", "a", prompt=100, output=700, min_output=1)
    assert (first.output, first.capped, first.tokens) == (700, False, 800)
    second = await b.reserve(t, "m", "b", prompt=50, output=500, min_output=1)
    assert (second.prompt, second.output, second.capped, second.tokens) == (50, 150, True, 200)
    # The budgets say what they granted; the director writes the limit into the body and its headers.
    assert second.asked == 500 and "x-modeldock-output-limit" not in second.headers
    assert second.headers["x-ratelimit-binding-tokens"] == "tokens_per_minute"
    assert second.headers["x-ratelimit-remaining-tokens"] == "0"
    # Nothing left for even one output token: refused, holding nothing.
    with pytest.raises(RateLimited) as caught:
        await b.reserve(t, "m", "c", prompt=0, output=10, min_output=1)
    assert caught.value.code == "tokens_rate_limited"
    assert b.held_count() == 2


async def test_without_cap_output_to_budget_a_request_that_does_not_fit_is_refused() -> None:
    t = budget_tenant(tpm=1000)
    b = TokenBudgets(budget_config(t, cap_output_to_budget=False), FakeClock())
    await b.reserve(t, "m", "a", prompt=100, output=700, min_output=1)
    with pytest.raises(RateLimited) as caught:
        await b.reserve(t, "m", "b", prompt=50, output=500, min_output=1)
    assert caught.value.code == "tokens_rate_limited" and b.held_count() == 1


async def test_a_prompt_plus_minimum_above_the_limit_is_too_large() -> None:
    t = budget_tenant(tpm=100)
    b = TokenBudgets(budget_config(t), FakeClock())
    with pytest.raises(RateLimited) as caught:
        await b.reserve(t, "m", "a", prompt=95, output=500, min_output=6)
    assert caught.value.code == "tokens_request_too_large" and "Retry-After" not in caught.value.headers
    capped = await b.reserve(t, "m", "b", prompt=95, output=500, min_output=5)
    assert capped.output == 5


async def test_settlement_facts_follow_the_one_rule() -> None:
    t = budget_tenant(tpm=10_000)
    b = TokenBudgets(budget_config(t), FakeClock())
    error = await b.reserve(t, "m", "a", prompt=100, output=400)
    cut = await b.reserve(t, "m", "b", prompt=100, output=400)
    never = await b.reserve(t, "m", "c", prompt=100, output=400)
    error.finish_nowait(sent=True, usage=None, backend_error=True)
    cut.finish_nowait(sent=True, usage=None)
    never.finish_nowait(sent=False, usage=None)
    assert (error.charged, error.charged_usage) == (100, Usage(100, 0))  # the prompt: it generated nothing
    assert (cut.charged, cut.state) == (500, "charged")
    assert (never.charged, never.state) == (0, "refunded")
    assert b._local.used("modeldock:tb:{acme}:minute", 60.0) == 600


PRICE = PriceConfig(input=2.0, cached_input=0.5, output=8.0)  # per million tokens


async def test_a_cost_budget_reserves_the_ceiling_settles_the_price_and_caps() -> None:
    t = budget_tenant(cost_per_month=0.01)  # 10,000 millionths
    cfg = budget_config(t, price=PRICE)
    b, price = TokenBudgets(cfg, FakeClock()), model_price(cfg.models[0])
    r = await b.reserve(t, "m", "a", prompt=1000, output=1000, min_output=1, price=price)
    # 1000 x 2 + 1000 x 8 = 10,000 millionths: exactly the budget.
    assert r.output == 1000 and r.headers["x-ratelimit-remaining-cost"] == "0"
    assert r.headers["x-ratelimit-limit-cost"] == "0.01"
    assert r.headers["x-ratelimit-binding-tokens"] == "cost_per_month"
    # 800 of the prompt were cached: 200 x 2 + 800 x 0.5 + 200 x 8 = 2,400 millionths.
    await r.finish(sent=True, usage=Usage(1000, 200, cached_tokens=800))
    assert r.charged_cost == pytest.approx(0.0024) and r.charged == 1200
    # 7,600 left: a 1000-token prompt (2,000) leaves room for 700 output tokens at 8.
    capped = await b.reserve(t, "m", "b", prompt=1000, output=1000, min_output=1, price=price)
    assert (capped.output, capped.capped) == (700, True)
    assert capped.headers["x-ratelimit-remaining-cost"] == "0"
    with pytest.raises(RateLimited, match="cost per month") as caught:
        await b.reserve(t, "m", "c", prompt=1, output=0, price=price)
    assert caught.value.headers["x-ratelimit-binding-tokens"] == "cost_per_month"
    capped.refund_nowait()
    assert b._local.used(_month_key(b, "cost:month"), -1) == 2400


def _month_key(b: TokenBudgets, name: str) -> str:
    return f"modeldock:tb:{{acme}}:{name}:2023-11"  # FakeClock's wall: 2023-11-14


def test_a_cost_budget_needs_a_price_on_every_model_and_zones_are_checked() -> None:
    base = {"models": [{"name": "m", "endpoints": ["127.0.0.1:8000"]}]}
    tenant = {"id": "t", "api_key_hashes": ["sha256:" + "0" * 64], "models": ["*"], "cost_per_month": 5}
    with pytest.raises(ConfigError, match="cost_per_month") as caught:
        parse_config({**base, "tenants": [tenant]})
    assert "price" in str(caught.value)
    priced = {"models": [{"name": "m", "endpoints": ["127.0.0.1:8000"], "price": {"input": 1, "output": 2}}]}
    assert parse_config({**priced, "tenants": [tenant]}).models[0].price is not None
    with pytest.raises(ConfigError, match="budget_timezone"):
        parse_config({**base, "limits": {"budget_timezone": "Mars/Olympus"}})
    with pytest.raises(ConfigError, match="budget_timezone"):
        parse_config({**base, "tenants": [{**tenant, "cost_per_month": 0, "budget_timezone": "../etc/x"}]})
