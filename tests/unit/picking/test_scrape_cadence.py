"""The per-endpoint read schedule (cadence.py), on a stepped clock: pure bookkeeping, no I/O."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from picking_helpers import endpoints

from modeldock.picking.cadence import Cadence
from modeldock.types import Endpoint

pytestmark = pytest.mark.timeout(30)


def _run(cadence: Cadence, eps: list[Endpoint], busy: set[Endpoint], seconds: float,
         step: float = 0.01) -> dict[Endpoint, list[float]]:
    """Wake every `step` and start every read due: the read start times per endpoint."""
    starts: dict[Endpoint, list[float]] = {ep: [] for ep in eps}
    now = 0.0
    cadence.sync(eps, now)
    while now <= seconds:
        for ep in cadence.due(now):
            cadence.started(ep, now, ep in busy)
            starts[ep].append(now)
        now = round(now + step, 6)
    return starts


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def test_busy_endpoints_every_interval_idle_ones_every_idle_interval() -> None:
    eps = endpoints(20)
    cadence = Cadence(0.5, 1.25)
    starts = _run(cadence, eps, busy=set(eps[:5]), seconds=30)
    for ep in eps[:5]:
        assert all(0.5 - cadence.slack - 1e-9 <= g <= 0.5 + 1e-9 for g in _gaps(starts[ep]))
        assert len(starts[ep]) >= 30 / 0.5
    for ep in eps[5:]:
        gaps = _gaps(starts[ep])
        assert all(g <= 1.25 + 1e-9 for g in gaps)  # the staleness bound: never longer
        assert 0.5 - cadence.slack - 1e-9 <= gaps[0]  # the first idle gap is spread between the cadences
        assert all(g >= 1.25 - cadence.slack - 1e-9 for g in gaps[1:])
        assert len(starts[ep]) <= 30 / (1.25 - cadence.slack) + 2


def test_first_idle_gaps_spread_the_reads() -> None:
    cadence = Cadence(0.5, 2.5)
    eps = endpoints(200)
    cadence.sync(eps, 0.0)
    for ep in eps:
        cadence.started(ep, 0.0, busy=False)
    due = sorted(t for ep in eps if (t := cadence.due_at(ep)) is not None)
    assert 0.5 <= due[0] and due[-1] <= 2.5
    buckets = [sum(1 for t in due if lo <= t < lo + 0.5) for lo in (0.5, 1.0, 1.5, 2.0)]
    assert min(buckets) >= 30  # about 50 in each half second: no single burst


def test_hurry_puts_an_idle_endpoint_on_the_busy_cadence_never_later() -> None:
    ep = endpoints(1)[0]
    cadence = Cadence(0.5, 1.25)
    cadence.sync([ep], 0.0)
    cadence.started(ep, 0.0, busy=False)
    cadence.started(ep, 1.0, busy=False)  # a second idle read: due at 2.25
    assert cadence.due_at(ep) == 2.25
    assert cadence.hurry(ep) == 1.5  # its last read + the interval
    assert cadence.hurry(ep) == 1.5
    cadence.started(ep, 1.5, busy=True)
    assert cadence.hurry(ep) == 2.0  # already busy: unchanged
    assert cadence.hurry(Endpoint("10.9.9.9", 1)) is None


def test_a_failed_read_is_retried_at_the_busy_cadence() -> None:
    ep = endpoints(1)[0]
    cadence = Cadence(0.5, 1.25)
    cadence.sync([ep], 0.0)
    cadence.started(ep, 0.0, busy=False)
    cadence.started(ep, 1.0, busy=False)
    cadence.failed(ep)
    assert cadence.due_at(ep) == 1.5


def test_fixed_rounds_without_an_idle_interval() -> None:
    eps = endpoints(3)
    for idle in (None, 0.5, 0.2):  # none, or not above the interval: every endpoint every interval
        cadence = Cadence(0.5, idle)
        assert not cadence.adaptive
        starts = _run(cadence, eps, busy=set(), seconds=5)
        assert all(len(times) >= 10 for times in starts.values())


def test_endpoints_follow_the_snapshot() -> None:
    a, b, c = endpoints(3)
    cadence = Cadence(0.5, 1.25)
    cadence.sync([a, b], 0.0)
    assert set(cadence.due(0.0)) == {a, b}
    for ep in (a, b):
        cadence.started(ep, 0.0, busy=True)
    cadence.sync([b, c], 0.1)
    assert cadence.due(0.1) == [c]  # new: due at once; a forgotten
    assert cadence.due_at(a) is None and cadence.last_read(a) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=200), st.floats(0.6, 4.0), st.integers(1, 8))
def test_the_gap_between_reads_never_exceeds_the_cadence(flips: list[bool], idle: float, n: int) -> None:
    """Busy or idle flipping at every step (picks, endings): a read's next is never later than the
    cadence it was started at, and a hurry never pushes a read back."""
    eps = endpoints(n)
    cadence = Cadence(0.5, idle)
    cadence.sync(eps, 0.0)
    last: dict[Endpoint, tuple[float, bool]] = {}
    now = 0.0
    for i, flip in enumerate(flips):
        ep = eps[i % n]
        if flip:
            before = cadence.due_at(ep)
            after = cadence.hurry(ep)
            assert before is not None and after is not None and after <= before
        for due in cadence.due(now):
            if due in last:
                started, busy = last[due]
                assert now - started <= (0.5 if busy else idle) + 0.05 + 1e-9
            cadence.started(due, now, flip)
            last[due] = (now, flip)
        now += 0.05
