from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from modeldock.admission.limits import Admission
from modeldock.admission.window import SlidingWindow
from modeldock.clock import FakeClock
from modeldock.errors import RateLimited
from tests.unit.admission.admission_helpers import config, tenant

WINDOW = 60.0

steps = st.one_of(
    st.just(0.0),
    st.sampled_from([0.001, 1.0, 10.0, 59.999, 60.0, 60.001]),
    st.floats(min_value=0, max_value=90, allow_nan=False, allow_infinity=False),
)
ops = st.lists(st.tuples(steps, st.sampled_from(["a", "b"])), max_size=300)


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(min_value=1, max_value=6), ops=ops)
def test_never_more_than_limit_in_any_window_and_never_fewer(limit: int, ops: list[tuple[float, str]]) -> None:
    clock = FakeClock()
    window = SlidingWindow(clock, WINDOW)
    admitted: dict[str, list[float]] = {"a": [], "b": []}
    for dt, key in ops:
        clock.advance(dt)
        now = clock.monotonic()
        in_window = [t for t in admitted[key] if not now - t >= WINDOW]
        decision = window.try_acquire(key, limit)
        # Exact: admitted if and only if fewer than `limit` admissions are in (now - 60, now].
        assert decision.allowed == (len(in_window) < limit)
        if decision.allowed:
            admitted[key].append(now)
            assert decision.remaining == limit - len(in_window) - 1
        else:
            assert decision.remaining == 0
            assert 0 < decision.retry_after_s <= WINDOW
    for times in admitted.values():
        # Any limit+1 consecutive admissions span at least a full window.
        for i in range(len(times) - limit):
            assert times[i + limit] - times[i] >= WINDOW


@settings(max_examples=100, deadline=None)
@given(
    max_in_flight=st.integers(min_value=1, max_value=4),
    actions=st.lists(st.sampled_from(["admit", "release", "release_twice"]), max_size=60),
)
def test_in_flight_matches_unreleased_tickets(max_in_flight: int, actions: list[str]) -> None:
    async def run() -> None:
        t = tenant(max_in_flight=max_in_flight, rpm=10_000)
        admission = Admission(config(t), FakeClock())
        held = []
        for action in actions:
            if action == "admit":
                try:
                    held.append(await admission.admit(t, "m"))
                except RateLimited:
                    assert len(held) == max_in_flight
            elif held:
                ticket = held.pop(0)
                ticket.release()
                if action == "release_twice":
                    ticket.release()
            assert admission.in_flight(t.id) == len(held) <= max_in_flight
        await admission.close()

    asyncio.run(run())
