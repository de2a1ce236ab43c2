"""predicted_wait counts the backend's own queue: requests waiting there are served before a new one,
each at the average size of this gateway's requests there (the queue's sizes are not known)."""

from __future__ import annotations

import pytest

from modeldock.picking.signals import Sample, Signals
from modeldock.picking.wait import PredictedWait

WAIT = PredictedWait(half=2.0)


def signals(*, waiting_in_sample: float, fresh: bool = True, corrected_waiting: float | None = None,
            in_flight: int = 2, committed: int = 1000) -> Signals:
    sample = Sample(waiting=waiting_in_sample, running=2.0, kv=0.3)
    waiting = waiting_in_sample if corrected_waiting is None else corrected_waiting
    return Signals(in_flight=in_flight, fresh=fresh, waiting=waiting if fresh else 0.0,
                   running=2.0 if fresh else 0.0, kv=0.3 if fresh else 0.0, sample=sample,
                   committed=committed, speed=1000.0)


def test_the_backends_queue_adds_its_requests_at_the_average_committed_size() -> None:
    # 1000 tokens committed over 2 requests (500 each), 2 more waiting in vLLM's queue: 2000 tokens
    # at 1000 tokens/s, 2 s, which is `half`: 0.5. Without the queue it would be 1 s: 1 / 3.
    assert WAIT(signals(waiting_in_sample=0)) == pytest.approx(1 / 3)
    assert WAIT(signals(waiting_in_sample=2)) == pytest.approx(0.5)
    # 6 waiting: 1000 + 3000 tokens, 4 s: 4 / 6.
    assert WAIT(signals(waiting_in_sample=6)) == pytest.approx(2 / 3)


def test_of_two_endpoints_alike_the_one_with_a_queue_waits_longer() -> None:
    assert WAIT(signals(waiting_in_sample=1)) > WAIT(signals(waiting_in_sample=0))


def test_the_queue_is_the_samples_not_the_corrected_count() -> None:
    # The corrected `waiting` also counts this gateway's picks since the sample, which `committed`
    # holds already: counting them again would double them.
    assert WAIT(signals(waiting_in_sample=2, corrected_waiting=5)) == pytest.approx(0.5)


def test_a_stale_sample_queue_is_not_counted() -> None:
    assert WAIT(signals(waiting_in_sample=6, fresh=False)) == pytest.approx(1 / 3)


def test_nothing_of_ours_in_flight_is_no_wait_whatever_the_queue() -> None:
    # No committed size to count the queue at (and nothing to divide by).
    assert WAIT(signals(waiting_in_sample=4, in_flight=0, committed=0)) == 0.0
