"""RedisBatch against a real Redis/Valkey (tests.support.redis_server); flush timers fired by hand."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol

import pytest
import pytest_asyncio
import redis.asyncio

from modeldock.budgets.redis_batch import RedisBatch, Script
from modeldock.redis_client import RedisUnavailable, make_batch_client
from tests.support.manual_timers import ManualTimers
from tests.support.redis_server import RedisServer

LOG = "test:{batch}:log"
PUSH = Script("return redis.call('RPUSH', KEYS[1], ARGV[1])")  # replies with the list's length
FAIL = Script("return redis.error_reply('boom')")


class Errors(list[RedisUnavailable]):
    def __call__(self, exc: RedisUnavailable) -> None:
        self.append(exc)


class BatchFactory(Protocol):
    def __call__(self, *, timeout_s: float = 2.0, max_batch: int = 64) -> RedisBatch: ...


@pytest.fixture
def errors() -> Errors:
    return Errors()


@pytest_asyncio.fixture
async def make_batch(redis_server: RedisServer, timers: ManualTimers) -> AsyncIterator[BatchFactory]:
    """Batchers on the test's Redis with hand-fired timers, each closed at the end (close is bounded
    by its own timeout_s, and idempotent)."""
    made: list[RedisBatch] = []

    def make(*, timeout_s: float = 2.0, max_batch: int = 64) -> RedisBatch:
        made.append(RedisBatch(lambda: make_batch_client(redis_server.url, timeout_s), timeout_s=timeout_s,
                               max_batch=max_batch, call_later=timers.call_later))
        return made[-1]

    try:
        yield make
    finally:
        # A test that paused or stopped Redis: each close flushes what is queued, so give it a Redis.
        redis_server.resume()
        if not redis_server.running:
            redis_server.start()
        for batch in made:
            await batch.close()


@pytest_asyncio.fixture
async def log(redis_server: RedisServer) -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        yield client
    finally:
        await client.aclose()


async def logged(client: redis.asyncio.Redis) -> list[str]:
    return list(await client.lrange(LOG, 0, -1))  # type: ignore[misc]


async def test_a_lone_call_goes_at_once_and_concurrent_calls_share_the_next_write(
    log: redis.asyncio.Redis, make_batch: BatchFactory, timers: ManualTimers
) -> None:
    batch = make_batch()
    assert await batch.call(PUSH, [LOG], ["solo"]) == 1
    assert batch.round_trips == 1 and timers.armed == []
    first = asyncio.ensure_future(batch.call(PUSH, [LOG], ["c0"]))
    await asyncio.sleep(0)  # sent at once
    rider = batch.defer(PUSH, [LOG], ["rider"], Errors())
    replies = await asyncio.gather(first, *(batch.call(PUSH, [LOG], [f"c{i}"]) for i in range(1, 10)))
    # The nine made while the first was in flight go together when it returns, after the item
    # deferred meanwhile.
    assert batch.round_trips == 3 and rider.done()
    assert replies == [2, *range(4, 13)]  # each its own reply, in the order called
    assert await logged(log) == ["solo", "c0", "rider", *(f"c{i}" for i in range(1, 10))]


async def test_deferred_items_wait_for_the_timer_or_ride_with_the_next_call(
    log: redis.asyncio.Redis, make_batch: BatchFactory, timers: ManualTimers, errors: Errors
) -> None:
    batch = make_batch()
    done = [batch.defer(PUSH, [LOG], [f"d{i}"], errors) for i in range(3)]
    await asyncio.sleep(0)
    assert batch.round_trips == 0 and timers.armed == [batch.flush_interval_s]  # one timer for the queue
    assert timers.fire() == 1
    await asyncio.gather(*done)
    assert batch.round_trips == 1 and await logged(log) == ["d0", "d1", "d2"]
    later = [batch.defer(PUSH, [LOG], [f"e{i}"], errors) for i in range(2)]
    assert await batch.call(PUSH, [LOG], ["call"]) == 6  # queued deferred items go first, same write
    assert all(f.done() for f in later) and batch.round_trips == 2
    assert timers.fire() == 1  # the timer armed for them finds nothing left and sends nothing
    await asyncio.sleep(0)
    assert batch.round_trips == 2 and errors == []
    assert await logged(log) == ["d0", "d1", "d2", "e0", "e1", "call"]


async def test_a_full_queue_is_sent_without_waiting_for_the_timer(
    log: redis.asyncio.Redis, make_batch: BatchFactory, timers: ManualTimers, errors: Errors
) -> None:
    batch = make_batch(max_batch=4)
    done = [batch.defer(PUSH, [LOG], [f"d{i}"], errors) for i in range(9)]
    await asyncio.gather(*done[:8])  # two full writes went without the timer
    assert batch.round_trips == 2 and len(await logged(log)) == 8
    assert not done[8].done()
    timers.fire()
    await done[8]
    assert await logged(log) == [f"d{i}" for i in range(9)] and errors == []


async def test_an_error_reply_fails_only_its_own_item(
    log: redis.asyncio.Redis, make_batch: BatchFactory, errors: Errors
) -> None:
    batch = make_batch()
    deferred = [batch.defer(FAIL, [LOG], [], errors), batch.defer(PUSH, [LOG], ["ok"], errors)]
    first = asyncio.ensure_future(batch.call(PUSH, [LOG], ["first"]))
    await asyncio.sleep(0)  # in flight, carrying both deferred items
    results = await asyncio.gather(batch.call(FAIL, [LOG], []), batch.call(PUSH, [LOG], ["after"]),
                                   return_exceptions=True)
    assert await first == 2
    assert isinstance(results[0], RedisUnavailable) and "boom" in str(results[0])
    assert results[1] == 3
    await asyncio.gather(*deferred)
    assert len(errors) == 1 and "boom" in str(errors[0])
    assert await logged(log) == ["ok", "first", "after"]


async def test_a_hung_redis_bounds_calls_in_flight_and_queued(
    redis_server: RedisServer, make_batch: BatchFactory
) -> None:
    batch = make_batch(timeout_s=0.2)
    await batch.call(PUSH, [LOG], ["warm"])
    redis_server.pause()
    started = time.monotonic()
    results = await asyncio.gather(*(batch.call(PUSH, [LOG], [f"c{i}"]) for i in range(3)),
                                   return_exceptions=True)
    assert all(isinstance(r, RedisUnavailable) and "no answer within 200 ms" in str(r) for r in results)
    assert time.monotonic() - started < 1.5
    redis_server.resume()
    assert await batch.call(PUSH, [LOG], ["back"]) >= 2  # reconnected on its own


async def test_a_call_cancelled_in_flight_sends_its_deferred_riders_again(
    redis_server: RedisServer, log: redis.asyncio.Redis, make_batch: BatchFactory, errors: Errors
) -> None:
    batch = make_batch()
    await batch.call(PUSH, [LOG], ["warm"])
    rider = batch.defer(PUSH, [LOG], ["rider"], errors)
    redis_server.pause()
    caller = asyncio.ensure_future(batch.call(PUSH, [LOG], ["cancelled"]))
    await asyncio.sleep(0.05)
    queued = asyncio.ensure_future(batch.call(PUSH, [LOG], ["never"]))
    await asyncio.sleep(0)
    queued.cancel()  # cancelled before it was sent: it never runs
    caller.cancel()
    for task in (caller, queued):
        with pytest.raises(asyncio.CancelledError):
            await task
    assert not rider.done()
    redis_server.resume()
    await batch.flush()
    assert rider.done() and errors == []
    # The cancelled call reached Redis before the cut (it may run: undoing it is the caller's job);
    # its rider went again and counts once more, as settlements (absolute amounts) may.
    assert await logged(log) == ["warm", "rider", "cancelled", "rider"]


async def test_close_flushes_the_queue_and_is_bounded_when_redis_hangs(
    redis_server: RedisServer, log: redis.asyncio.Redis, make_batch: BatchFactory, timers: ManualTimers, errors: Errors
) -> None:
    batch = make_batch(timeout_s=0.2)
    done = [batch.defer(PUSH, [LOG], [f"d{i}"], errors) for i in range(3)]
    await batch.close()
    assert all(f.done() for f in done) and await logged(log) == ["d0", "d1", "d2"] and errors == []
    assert timers.armed == []
    # Closed, then used again (a settlement for a retired window): sent at once, the client closed after.
    await batch.defer(PUSH, [LOG], ["late"], errors)
    assert (await logged(log))[-1] == "late"
    redis_server.pause()
    stuck = batch.defer(PUSH, [LOG], ["stuck"], errors)
    # Bounded by the 0.2 s timeout: a close that waited on the hung Redis would hit this far larger bound
    # and fail (no wall-clock threshold to flake on a loaded machine).
    async with asyncio.timeout(10):
        await batch.close()
    assert stuck.done() and len(errors) == 1


async def test_scripts_are_loaded_again_after_a_flush_or_a_restart(
    redis_server: RedisServer, make_batch: BatchFactory
) -> None:
    batch = make_batch()
    client = redis.asyncio.Redis.from_url(redis_server.url)
    try:
        assert await batch.call(PUSH, [LOG], ["a"]) == 1
        await client.script_flush()
        assert await batch.call(PUSH, [LOG], ["b"]) == 2  # NOSCRIPT: loaded and sent again
        redis_server.start()  # a restart: the held connection is dead, the data gone
        assert await batch.call(PUSH, [LOG], ["c"]) == 1  # reconnected and retried once
    finally:
        await client.aclose()


async def test_redis_down_fails_each_call_and_deferred_item(
    redis_server: RedisServer, make_batch: BatchFactory, errors: Errors
) -> None:
    batch = make_batch(timeout_s=0.5)
    redis_server.stop()
    deferred = batch.defer(PUSH, [LOG], ["d"], errors)
    with pytest.raises(RedisUnavailable, match="ConnectionError"):
        await batch.call(PUSH, [LOG], ["c"])
    await deferred
    assert len(errors) == 1 and "ConnectionError" in str(errors[0])

