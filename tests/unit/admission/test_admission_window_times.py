"""The seconds a local window decision reports (they become x-ratelimit-reset-requests and
Retry-After): exact for a limit of one, below one second near expiry, and zero for a key that
was not the reason for a refusal."""

from __future__ import annotations

from modeldock.admission.window import SlidingWindow
from modeldock.clock import FakeClock


def test_limit_of_one_retries_when_its_entry_expires() -> None:
    clock = FakeClock()
    window = SlidingWindow(clock, 60)
    assert window.try_acquire("k", 1).allowed
    clock.advance(10)
    refused = window.try_acquire("k", 1)
    assert not refused.allowed
    assert refused.retry_after_s == 50.0 and refused.reset_after_s == 50.0


def test_retry_can_be_under_a_second() -> None:
    clock = FakeClock()
    window = SlidingWindow(clock, 60)
    window.try_acquire("k", 1)
    clock.advance(59.75)
    refused = window.try_acquire("k", 1)
    assert not refused.allowed and refused.retry_after_s == 0.25


def test_a_key_with_room_reports_no_wait_when_another_key_refuses() -> None:
    clock = FakeClock()
    window = SlidingWindow(clock, 60)
    window.try_acquire("full", 1)
    full, roomy = window.try_acquire_all([("full", 1), ("roomy", 5)])
    assert not full.allowed and not roomy.allowed  # all or nothing
    assert (roomy.remaining, roomy.reset_after_s, roomy.retry_after_s) == (5, 0.0, 0.0)
    assert window.count("roomy") == 0
