from __future__ import annotations

import pytest

from modeldock.admission.window import Decision, SlidingWindow, binding
from modeldock.clock import FakeClock


def test_admits_exactly_the_limit_then_frees_one_slot_60s_after_the_oldest() -> None:
    clock = FakeClock()
    window = SlidingWindow(clock)
    first = window.try_acquire("k", 3)
    assert (first.allowed, first.remaining, first.reset_after_s) == (True, 2, 60.0)
    clock.advance(10)
    assert window.try_acquire("k", 3).remaining == 1
    clock.advance(10)
    assert window.try_acquire("k", 3).remaining == 0

    rejected = window.try_acquire("k", 3)
    assert not rejected.allowed
    assert rejected.remaining == 0
    assert rejected.retry_after_s == 40.0  # oldest was 20 s ago
    assert rejected.reset_after_s == 60.0  # the newest was just now

    clock.advance(39.999)
    assert not window.try_acquire("k", 3).allowed
    clock.advance(0.001)  # exactly 60 s after the oldest
    again = window.try_acquire("k", 3)
    assert again.allowed and again.remaining == 0
    assert not window.try_acquire("k", 3).allowed


def test_rejections_take_no_slot() -> None:
    clock = FakeClock()
    window = SlidingWindow(clock)
    window.try_acquire("k", 1)
    for _ in range(100):
        assert not window.try_acquire("k", 1).allowed
    assert window.count("k") == 1
    clock.advance(60)
    assert window.try_acquire("k", 1).allowed


def test_keys_are_independent() -> None:
    window = SlidingWindow(FakeClock())
    assert window.try_acquire("a", 1).allowed
    assert window.try_acquire("b", 1).allowed
    assert not window.try_acquire("a", 1).allowed


def test_all_or_nothing_across_keys() -> None:
    window = SlidingWindow(FakeClock())
    assert all(d.allowed for d in window.try_acquire_all([("tenant", 5), ("model", 1)]))
    decisions = window.try_acquire_all([("tenant", 5), ("model", 1)])
    assert [d.allowed for d in decisions] == [False, False]
    assert window.count("tenant") == 1  # the tenant slot was not taken for the rejected request
    assert decisions[binding(decisions)].limit == 1


def test_lowered_limit_waits_for_enough_entries_to_expire() -> None:
    clock = FakeClock()
    window = SlidingWindow(clock)
    for _ in range(5):
        window.try_acquire("k", 5)
        clock.advance(1)
    rejected = window.try_acquire("k", 2)
    assert not rejected.allowed
    # Entries at t=0..4 (now t=5); the count drops below 2 when the entry at t=3 expires.
    assert rejected.retry_after_s == pytest.approx(58.0)
    clock.advance(58)
    assert window.try_acquire("k", 2).allowed


def test_undo_gives_back_the_right_slot() -> None:
    clock = FakeClock()
    window = SlidingWindow(clock)
    early = window.try_acquire("k", 2)
    clock.advance(30)
    window.try_acquire("k", 2)
    window.undo("k", early.at)
    assert window.count("k") == 1
    # The remaining entry is the later one, so it is still held 30 s later.
    clock.advance(30)
    assert window.count("k") == 1
    window.undo("k", 12345.0)  # unknown entries are ignored
    window.undo("missing", 1.0)
    assert window.count("k") == 1


def test_idle_keys_are_pruned() -> None:
    clock = FakeClock()
    window = SlidingWindow(clock)
    for i in range(1000):
        window.try_acquire(f"k{i}", 10)
    assert len(window) == 1000
    clock.advance(60)
    window.try_acquire("fresh", 10)
    assert len(window) == 1


def test_memory_per_key_is_bounded_by_the_limit() -> None:
    window = SlidingWindow(FakeClock())
    for _ in range(10_000):
        window.try_acquire("k", 7)
    assert window.count("k") == 7


def test_configurable_window() -> None:
    clock = FakeClock()
    window = SlidingWindow(clock, window_seconds=1.0)
    assert window.try_acquire("k", 1).allowed
    clock.advance(1.0)
    assert window.try_acquire("k", 1).allowed
    with pytest.raises(ValueError):
        SlidingWindow(clock, window_seconds=0)


def test_binding_prefers_longest_rejection_then_fewest_remaining() -> None:
    def d(allowed: bool, remaining: int, retry: float = 0.0, reset: float = 0.0) -> Decision:
        return Decision(allowed, 10, remaining, reset, retry)

    assert binding([d(True, 5), d(True, 2)]) == 1
    assert binding([d(True, 2, reset=1), d(True, 2, reset=9)]) == 1
    assert binding([d(False, 0, retry=3), d(False, 0, retry=7)]) == 1
    assert binding([d(False, 0, retry=3), d(False, 4)]) == 0
    with pytest.raises(ValueError):
        binding([])
