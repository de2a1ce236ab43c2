"""Hypothesis: token budgets agree with a plain model of reserved-then-settled amounts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from modeldock.budgets.budgets import Reservation, TokenBudgets
from modeldock.budgets.tokens import Usage
from modeldock.clock import FakeClock
from modeldock.errors import RateLimited
from tests.unit.budgets.budget_helpers import budget_config, budget_tenant

WINDOW = 60.0


@dataclass
class Entry:
    """The model of one request's reservation."""

    at: float
    amount: int
    finished: bool = False
    outcome: int | None = None  # the first settlement's amount
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
        model: dict[str, Entry] = {}  # each request id's latest reservation
        entries: list[Entry] = []  # every reservation made (an id may be reused once settled)
        objects: dict[str, Reservation] = {}

        def in_window() -> int:
            now = clock.monotonic()
            return sum(e.amount for e in entries if now - e.at < WINDOW)

        for kind, value, who in actions:
            rid = f"r{who}"
            entry = model.get(rid)
            if kind == "advance":
                clock.advance(value)
            elif kind == "reserve":
                live = entry is not None and not entry.finished
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
                    model[rid] = Entry(clock.monotonic(), value)
                    entries.append(model[rid])
            elif entry is not None:
                r = objects[rid]
                first = not entry.finished
                in_win = clock.monotonic() - entry.at < WINDOW
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
                    entry.finished, entry.outcome = True, amount
                    if in_win:
                        entry.amount = amount
                assert r.charged == entry.outcome  # exactly once: the first outcome stands
            assert budgets._local.used(KEY, WINDOW) == in_window()

    asyncio.run(run())
