"""RedisWindow's own answers against a real server: the numbers a decision carries (they become
the x-ratelimit-* and Retry-After headers) and the reason it gives when Redis does not answer."""

from __future__ import annotations

import pytest

from modeldock.admission.redis_window import RedisWindow
from modeldock.redis_client import RedisUnavailable, make_redis_client
from tests.support.redis_server import RedisServer, free_port


def window(url: str, timeout_s: float = 0.5) -> RedisWindow:
    return RedisWindow(lambda: make_redis_client(url, timeout_s), timeout_s=timeout_s, window_seconds=60)


async def test_fresh_admission_resets_after_the_whole_window_and_needs_no_retry(redis_server: RedisServer) -> None:
    w = window(redis_server.url)
    try:
        first = await w.try_acquire("t-decisions:a", 2)
        assert first.allowed and first.remaining == 1
        # The entry was written in the same script call that measured it: exactly one window left.
        assert first.reset_after_s == 60.0
        assert first.retry_after_s == 0.0
        await w.try_acquire("t-decisions:a", 2)
        refused = await w.try_acquire("t-decisions:a", 2)
        assert not refused.allowed and refused.remaining == 0
        assert 59.0 < refused.retry_after_s <= 60.0
        assert 59.0 < refused.reset_after_s <= 60.0
    finally:
        await w.close()


async def test_hung_redis_reason_names_the_timeout(redis_server: RedisServer) -> None:
    w = window(redis_server.url, timeout_s=1.0)
    try:
        await w.try_acquire("t-decisions:b", 5)  # connected before the hang
        redis_server.pause()
        with pytest.raises(RedisUnavailable, match=r"^no answer within 1000 ms$"):
            await w.try_acquire("t-decisions:b", 5)
    finally:
        redis_server.resume()
        await w.close()


async def test_unreachable_redis_reason_names_the_error_type() -> None:
    w = window(f"redis://127.0.0.1:{free_port()}/0")
    try:
        with pytest.raises(RedisUnavailable, match=r"^ConnectionError: ") as info:
            await w.try_acquire("t-decisions:c", 5)
        assert "redis://" not in str(info.value)  # the reason never carries the URL
    finally:
        await w.close()
