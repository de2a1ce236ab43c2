"""Token budgets on local windows (no Redis), with a FakeClock."""

from __future__ import annotations

import asyncio

import pytest

from modeldock.budgets.budgets import TokenBudgets, matching_budgets
from modeldock.budgets.tokens import Usage
from modeldock.budgets.window import TokenWindow
from modeldock.clock import FakeClock
from modeldock.config import ConfigError, TenantConfig, hash_key, parse_config
from modeldock.errors import RateLimited
from modeldock.flowcontrol.cost import estimate_cost
from tests.unit.budgets.budget_helpers import budget_config, budget_tenant


def make(
    tpm: int = 0, tpd: int = 0, per_model: dict[str, int] | None = None
) -> tuple[TokenBudgets, FakeClock, TenantConfig]:
    t = budget_tenant(tpm=tpm, tpd=tpd, per_model=per_model)
    clock = FakeClock()
    return TokenBudgets(budget_config(t), clock), clock, t


def used(b: TokenBudgets, name: str = "minute", window: float = 60.0) -> int:
    return b._local.used(f"modeldock:tb:{{acme}}:{name}", window)


async def test_settle_adjusts_to_the_real_total_lower_and_higher() -> None:
    b, _, t = make(tpm=1000)
    r1 = await b.reserve(t, "m", 300, "req-1")
    r2 = await b.reserve(t, "m", 200, "req-2")
    assert used(b) == 500
    assert r1.headers == {
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "700",
        "x-ratelimit-reset-tokens": "1m0s",
        "x-ratelimit-binding-tokens": "tokens_per_minute",
    }
    assert r2.headers["x-ratelimit-remaining-tokens"] == "500"
    await r1.finish(reached_backend=True, usage=Usage(40, 60))
    assert used(b) == 300 and r1.charged == 100 and r1.state == "settled"
    await r2.settle(450)  # more than reserved: charged in full
    assert used(b) == 550


async def test_refund_charge_reserved_and_exactly_once() -> None:
    b, _, t = make(tpm=1000)
    never = await b.reserve(t, "m", 300, "a")
    cut = await b.reserve(t, "m", 200, "b")
    await never.finish(sent=False, usage=None)
    await cut.finish(reached_backend=True, usage=None)  # the older keyword still works
    assert (never.state, never.charged) == ("refunded", 0)
    assert (cut.state, cut.charged) == ("charged", 200)
    assert used(b) == 200
    # Second and later calls, in any form, change nothing.
    await never.settle(999)
    await cut.refund()
    await cut.finish(reached_backend=True, usage=Usage(0, 1))
    assert used(b) == 200 and never.state == "refunded" and cut.charged == 200


async def test_concurrent_settles_apply_once() -> None:
    b, _, t = make(tpm=1000)
    r = await b.reserve(t, "m", 500, "x")
    await asyncio.gather(r.settle(10), r.refund(), r.charge_reserved(), r.settle(20))
    assert used(b) == 10 and r.charged == 10


async def test_same_request_reserves_once_until_settled() -> None:
    b, _, t = make(tpm=1000)
    first = await b.reserve(t, "m", 400, "req")
    again = await b.reserve(t, "m", 400, "req")  # e.g. a retry before the first byte
    assert again is first and used(b) == 400
    await first.settle(100)
    assert b.held("req") is None
    assert used(b) == 100


async def test_rejection_shape_and_retry_after_when_enough_frees() -> None:
    b, clock, t = make(tpm=1000)
    await b.reserve(t, "m", 300, "a")
    clock.advance(10)
    await b.reserve(t, "m", 500, "b")
    clock.advance(5)
    with pytest.raises(RateLimited) as caught:
        await b.reserve(t, "m", 400, "c")
    err = caught.value
    assert err.status == 429 and err.code == "tokens_rate_limited"
    assert err.body()["error"]["type"] == "rate_limit_error"
    # 400 fits once "a" (300) expires: 60 - 15 = 45 s later.
    assert err.headers["Retry-After"] == "45"
    assert err.headers["x-ratelimit-remaining-tokens"] == "200"
    assert b.held("c") is None and used(b) == 800
    with pytest.raises(RateLimited) as again:
        await b.reserve(t, "m", 600, "d")  # needs both to expire
    assert again.value.headers["Retry-After"] == "55"


async def test_window_edges() -> None:
    b, clock, t = make(tpm=100)
    await b.reserve(t, "m", 100, "a")
    clock.advance(59.999)
    with pytest.raises(RateLimited):
        await b.reserve(t, "m", 1, "b")
    clock.advance(0.001)  # exactly 60 s later the entry is gone
    r = await b.reserve(t, "m", 100, "c")
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"


async def test_settling_after_the_window_passed_changes_nothing() -> None:
    b, clock, t = make(tpm=100)
    r = await b.reserve(t, "m", 50, "a")
    clock.advance(61)
    await r.settle(90)
    assert used(b) == 0 and r.state == "settled"


async def test_day_budget_and_per_model_globs_all_apply() -> None:
    b, clock, t = make(tpm=1000, tpd=1500, per_model={"llama-*": 300, "*-70b": 200})
    assert matching_budgets(t.tokens_per_minute_per_model, "llama-70b") == [("*-70b", 200), ("llama-*", 300)]
    await b.reserve(t, "llama-8b", 300, "a")
    with pytest.raises(RateLimited, match="llama-"):
        await b.reserve(t, "llama-70b", 1, "b")
    # The rejected request took nothing anywhere (all or nothing).
    assert used(b) == 300 and used(b, "day:2023-11-14", -1) == 300 and used(b, "minute:model:*-70b") == 0
    r = await b.reserve(t, "qwen-70b", 200, "c")
    assert r.headers["x-ratelimit-limit-tokens"] == "200"  # the binding budget: fewest left
    for i in range(5):
        clock.advance(61)
        if i < 3:
            await b.reserve(t, "other", 300, f"d{i}")
    with pytest.raises(RateLimited, match="per day") as caught:
        await b.reserve(t, "other", 600, "e")
    # A calendar day (UTC): the FakeClock's wall starts at 2023-11-14 22:13:20Z and moved 305 s, so the
    # day ends at 2023-11-15 00:00:00Z (1700006400), 6095 s later; a sliding window would say 86100.
    assert caught.value.headers["Retry-After"] == "6095"
    assert caught.value.headers["x-ratelimit-binding-tokens"] == "tokens_per_day"


async def test_request_larger_than_a_budget_is_refused_without_retry_after() -> None:
    b, _, t = make(tpm=100)
    with pytest.raises(RateLimited) as caught:
        await b.reserve(t, "m", 101, "a")
    assert caught.value.code == "tokens_request_too_large" and "Retry-After" not in caught.value.headers
    assert used(b) == 0


async def test_no_budget_means_a_free_no_op_reservation() -> None:
    b, _, t = make()
    r = await b.reserve(t, "m", 10**9, "a")
    assert r.headers == {} and len(b._local) == 0
    await r.settle(5)
    assert r.state == "settled"


def test_window_reports_existing_id_without_adding() -> None:
    clock = FakeClock()
    w = TokenWindow(clock)
    limits = [("k", 10, 60.0)]
    assert w.try_reserve_all("id", 6, limits)[0].allowed
    assert w.try_reserve_all("id", 6, limits)[0].allowed
    assert w.used("k", 60.0) == 6
    assert w.settle("id", [("k", 60.0)], 0) == 1 and w.used("k", 60.0) == 0
    assert w.settle("id", [("k", 60.0)], 5) == 0


def test_estimate_and_usage_parsing() -> None:
    # The budgets' estimate: the body's bytes / 4 plus the output limit (the one estimator, lenient here).
    assert estimate_cost({"max_tokens": 100}, 1024, body_bytes=400).total == 200
    # Both limits set: the estimator counts the larger (whichever the backend applies).
    assert estimate_cost({"max_completion_tokens": 50, "max_tokens": 100, "n": 2}, 1024, body_bytes=4).total == 201
    assert estimate_cost({"max_tokens": True, "n": 0}, 7, body_bytes=0).total == 1  # vLLM's lax int: True is 1
    assert Usage.from_mapping({"prompt_tokens": 3, "completion_tokens": 4.0}) == Usage(3, 4)
    assert Usage.from_mapping({"prompt_tokens": 3}) is None
    assert Usage.from_mapping({"prompt_tokens": -1, "completion_tokens": 1}) is None
    assert Usage.from_mapping({"prompt_tokens": 1.5, "completion_tokens": 1}) is None
    assert Usage.from_mapping("x") is None


def test_a_token_budget_key_that_matches_no_served_name_is_a_config_error() -> None:
    def cfg(per_model: dict[str, int]) -> dict[str, object]:
        return {
            "tenants": [{"id": "acme", "api_key_hashes": [hash_key("k1")], "models": ["*"],
                         "tokens_per_minute_per_model": per_model}],
            "models": [{"name": "llama", "served_name": "meta/llama", "endpoints": ["127.0.0.1:1"]}],
        }

    # Budgets count per served name: the public alias `llama` alone would limit nothing.
    for bad in ({"x": 1}, {"llama": 1}, {"meta/*": 1, "mistral-*": 2}):
        with pytest.raises(ConfigError) as caught:
            parse_config(cfg(bad), "gw.yaml")
        key = next(k for k in bad if k != "meta/*")
        assert str(caught.value) == (
            f"gw.yaml: tenants[0].tokens_per_minute_per_model: {key!r} matches no model's served name")
    for good in ({"meta/llama": 1}, {"meta/*": 1}, {"*llama": 1}):
        parse_config(cfg(good))
