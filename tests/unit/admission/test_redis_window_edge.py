"""The shared window's edge, to the microsecond, on a real Redis: an entry scored exactly one window
before the script's `now` has left the window (its slot is back), one scored 1 µs later has not.

The script reads the server's `TIME`, which a test cannot set; so the module's own script runs behind a
preamble that shadows `redis` with a table whose `TIME` answers from a key the test writes (every other
command goes to the real server). The script text is read from the module at each test, unchanged."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio

from modeldock.admission import redis_window
from modeldock.admission.redis_window import RedisWindow
from modeldock.redis_client import make_redis_client
from tests.support.redis_server import RedisServer

NOW_KEY = "modeldock:test:now"
FAKE_TIME = f"""
local real_redis = redis
local redis = setmetatable({{call = function(cmd, ...)
  if cmd == 'TIME' then
    local us = tonumber(real_redis.call('GET', '{NOW_KEY}'))
    return {{tostring(math.floor(us / 1000000)), tostring(us % 1000000)}}
  end
  return real_redis.call(cmd, ...)
end}}, {{__index = real_redis}})
"""
WINDOW_US = 60_000_000
T = 1_700_000_000_500_000  # the script's `now`, in µs
KEY = "modeldock:rl:{edge}:all"


class Rig:
    def __init__(self, raw: redis.asyncio.Redis, window: RedisWindow) -> None:
        self.raw, self.window = raw, window

    async def at(self, now_us: int) -> None:
        await self.raw.set(NOW_KEY, str(now_us))

    async def members(self) -> list[tuple[bytes, float]]:
        reply: Any = await self.raw.zrange(KEY, 0, -1, withscores=True)  # redis's own types are loose
        return [(bytes(member), float(score)) for member, score in reply]


@pytest.fixture
async def rig(redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Rig]:
    monkeypatch.setattr(redis_window, "SLIDING_WINDOW_LUA", FAKE_TIME + redis_window.SLIDING_WINDOW_LUA)
    raw = redis.asyncio.Redis.from_url(redis_server.url, socket_timeout=2.0)
    window = RedisWindow(lambda: make_redis_client(redis_server.url, 2.0), timeout_s=2.0, window_seconds=60)
    try:
        await raw.set(NOW_KEY, str(T))
        yield Rig(raw, window)
    finally:
        await window.close()
        await raw.aclose()


async def test_an_entry_exactly_one_window_old_has_left_the_window(rig: Rig) -> None:
    await rig.raw.zadd(KEY, {"old": T - WINDOW_US})
    decision = await rig.window.try_acquire(KEY, 1)
    assert decision.allowed and decision.remaining == 0
    ((member, score),) = await rig.members()  # "old" was dropped: only the new entry, at `now`
    assert member != b"old" and score == T


async def test_an_entry_one_microsecond_inside_the_window_still_holds_its_slot(rig: Rig) -> None:
    await rig.raw.zadd(KEY, {"old": T - WINDOW_US + 1})
    decision = await rig.window.try_acquire(KEY, 1)
    assert not decision.allowed and decision.remaining == 0
    assert decision.retry_after_s == 1e-6 and decision.reset_after_s == 1e-6  # its slot frees in 1 µs
    assert await rig.members() == [(b"old", float(T - WINDOW_US + 1))]


async def test_a_slot_comes_back_exactly_one_window_after_it_was_taken(rig: Rig) -> None:
    first = await rig.window.try_acquire(KEY, 2)
    assert first.allowed and first.remaining == 1 and first.reset_after_s == 60.0
    await rig.at(T + 1_000_000)
    second = await rig.window.try_acquire(KEY, 2)
    assert second.allowed and second.remaining == 0
    await rig.at(T + WINDOW_US - 1)  # 1 µs before the first one's slot is back
    refused = await rig.window.try_acquire(KEY, 2)
    assert not refused.allowed and refused.retry_after_s == 1e-6
    assert refused.reset_after_s == 1.000001  # the second one leaves 1 s later
    await rig.at(T + WINDOW_US)
    back = await rig.window.try_acquire(KEY, 2)
    assert back.allowed and back.remaining == 0 and back.reset_after_s == 60.0
    assert [score for _, score in await rig.members()] == [T + 1_000_000, T + WINDOW_US]
