"""Hypothesis: token budgets agree with a plain model of reserved-then-settled amounts."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from modeldock.admission.budgets import Reservation, TokenBudgets
from modeldock.admission.tokens import Usage
from modeldock.clock import FakeClock
from modeldock.errors import RateLimited
from tests.unit.admission.budget_helpers import budget_config, budget_tenant

WINDOW = 60.0
KEY = "modeldock:tb:{acme}:minute"

actions = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.integers(0, 400), st.integers(0, 7)),
        st.tuples(st.just("settle"), st.integers(0, 600), st.integers(0, 7)),
        st.tuples(st.just("refund"), st.just(0), st.integers(0, 7)),
        st.tuples(st.just("unknown"), st.just(0), st.integers(0, 7)),
        st.tuples(st.just("advance"), st.sampled_from([0, 1, 30, 59, 60, 61]), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(1, 1000), actions=actions)
def test_budget_matches_the_model(limit: int, actions: list[tuple[str, int, int]]) -> None:
    async def run() -> None:
        clock = FakeClock()
        t = budget_tenant(tpm=limit)
        budgets = TokenBudgets(budget_config(t), clock)
        # request id -> [reserved at, amount, finished?, first outcome's amount]
        model: dict[str, list[float | int | bool | None]] = {}
        objects: dict[str, Reservation] = {}

        def in_window() -> int:
            now = clock.monotonic()
            return sum(int(e[1]) for e in model.values() if now - float(e[0]) < WINDOW)  # type: ignore[arg-type]

        for kind, value, who in actions:
            rid = f"r{who}"
            entry = model.get(rid)
            if kind == "advance":
                clock.advance(value)
            elif kind == "reserve":
                live = entry is not None and not entry[2]
                expected = live or (value <= limit and in_window() + value <= limit)
                try:
                    got = await budgets.reserve(t, "m", value, rid)
                except RateLimited as exc:
                    assert not expected
                    if exc.code == "tokens_rate_limited":
                        assert 0 < float(exc.headers["Retry-After"]) <= WINDOW
                    continue
                assert expected
                if live:
                    assert got is objects[rid]  # the same request: nothing reserved again
                else:
                    objects[rid] = got
                    model[rid] = [clock.monotonic(), value, False, None]
            elif entry is not None:
                r = objects[rid]
                first = not entry[2]
                in_win = clock.monotonic() - float(entry[0]) < WINDOW  # type: ignore[arg-type]
                if kind == "settle":
                    await r.finish(reached_backend=True, usage=Usage(value // 2, value - value // 2))
                    amount = value
                elif kind == "refund":
                    await r.finish(reached_backend=False, usage=None)
                    amount = 0
                else:
                    await r.finish(reached_backend=True, usage=None)
                    amount = r.cost
                if first:
                    entry[2] = True
                    entry[3] = amount
                    if in_win:
                        entry[1] = amount
                assert r.charged == entry[3]  # exactly once: the first outcome stands
            assert budgets._local.used(KEY, WINDOW) == in_window()

    asyncio.run(run())
