"""Nothing left behind: a window key given back to empty is dropped, a Redis client replaced on
reload is closed once calls that may still use it are over, and the outage log throttle lets a
line through again once its interval has passed."""

from __future__ import annotations

import asyncio
import time

import redis

from modeldock.admission.limits import Admission
from modeldock.admission.window import SlidingWindow
from modeldock.clock import FakeClock
from modeldock.redis_client import LogThrottle
from tests.support.redis_server import RedisServer
from tests.unit.admission.admission_helpers import config, tenant


def test_undo_of_the_only_entry_drops_the_key() -> None:
    window = SlidingWindow(FakeClock(), 60)
    decision = window.try_acquire("k", 5)
    assert decision.allowed and len(window) == 1
    window.undo("k", decision.at)
    assert window.count("k") == 0
    assert len(window) == 0, "an emptied key must not stay in memory"


def test_undo_of_one_of_two_entries_keeps_the_key() -> None:
    clock = FakeClock()
    window = SlidingWindow(clock, 60)
    first = window.try_acquire("k", 5)
    clock.advance(1)
    window.try_acquire("k", 5)
    window.undo("k", first.at)
    assert window.count("k") == 1 and len(window) == 1


def test_throttle_opens_again_exactly_after_its_interval() -> None:
    clock = FakeClock()
    throttle = LogThrottle(clock, 10.0)
    assert throttle.ready()
    clock.advance(9.999)
    assert not throttle.ready()
    clock.advance(0.001)  # 10 s after the first line
    assert throttle.ready()
    assert not throttle.ready()


def clients_of(server: RedisServer) -> int:
    """Connections to the server other than this probe's own."""
    probe = redis.Redis.from_url(server.url)
    try:
        return len(probe.client_list()) - 1
    finally:
        probe.close()


def wait_for(predicate: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


async def test_replaced_redis_client_is_closed_after_calls_using_it_are_over(redis_server: RedisServer) -> None:
    t = tenant(rpm=100)
    with RedisServer() as other:
        admission = Admission(config(t, redis_url=redis_server.url, redis_timeout_ms=50), FakeClock())
        try:
            await admission.admit(t, "m")
            assert clients_of(redis_server) == 1
            admission.reconfigure(config(t, redis_url=other.url, redis_timeout_ms=50))
            await admission.admit(t, "m")
            assert clients_of(other) == 1
            # Closed after 2 x timeout + 0.1 s (0.2 s here), by a task on this loop.
            for _ in range(100):
                if clients_of(redis_server) == 0:
                    break
                await asyncio.sleep(0.03)
            assert clients_of(redis_server) == 0, "the replaced client was never closed"
            assert clients_of(other) == 1
        finally:
            await admission.close()
        assert wait_for(lambda: clients_of(other) == 0, 3), "close() left the current client open"


async def test_turning_redis_on_by_reload_then_closing_is_clean(redis_server: RedisServer) -> None:
    t = tenant(rpm=100)
    admission = Admission(config(t), FakeClock())
    admission.reconfigure(config(t, redis_url=redis_server.url, redis_timeout_ms=200))
    await admission.admit(t, "m")
    assert clients_of(redis_server) == 1
    await admission.close()  # nothing was replaced, so nothing but the current client to close
    assert wait_for(lambda: clients_of(redis_server) == 0, 3)
