from __future__ import annotations

from modeldock.admission.concurrency import ConcurrencyLimiter


def test_limit_and_idempotent_release() -> None:
    limiter = ConcurrencyLimiter()
    a = limiter.try_acquire("t", 2)
    b = limiter.try_acquire("t", 2)
    assert a is not None and b is not None
    assert limiter.try_acquire("t", 2) is None
    a.release()
    a.release()
    a.release()
    assert limiter.in_flight("t") == 1
    c = limiter.try_acquire("t", 2)
    assert c is not None
    assert limiter.try_acquire("t", 2) is None
    b.release()
    c.release()
    assert limiter.in_flight("t") == 0
    assert limiter.total() == 0


def test_zero_means_unlimited_but_still_counted() -> None:
    limiter = ConcurrencyLimiter()
    slots = [limiter.try_acquire("t", 0) for _ in range(1000)]
    assert all(slots)
    assert limiter.in_flight("t") == 1000
    # A reload that adds a limit sees the true count.
    assert limiter.try_acquire("t", 5) is None


def test_tenants_are_independent_and_idle_keys_dropped() -> None:
    limiter = ConcurrencyLimiter()
    a = limiter.try_acquire("a", 1)
    assert limiter.try_acquire("b", 1) is not None
    assert limiter.try_acquire("a", 1) is None
    assert a is not None
    a.release()
    assert "a" not in limiter._in_flight
