"""The sliding-window log shared by all replicas, kept in Redis.

Same semantics as `window.SlidingWindow`, but the log is a sorted set per key
(member: a unique request id, score: the Redis server's time in microseconds)
and the whole check-and-add is one Lua script, so concurrent replicas cannot
both take the last slot. The script reads `TIME` on the Redis server, so the
replicas' own clocks do not matter.

Every call is bounded by `timeout_s`; any failure (refused, reset, timeout,
error reply) raises `RedisUnavailable` and the caller decides whether to fail
open or closed. The client (`modeldock.redis_client.make_redis_client`) reconnects by itself on
the next call.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from modeldock.admission.window import WINDOW_SECONDS, Decision
from modeldock.redis_client import RedisUnavailable
from modeldock.redis_metrics import RedisMetrics

KEY_PREFIX = "modeldock:rl:"

# KEYS[i]: one window (sorted set). ARGV[1]: window length in microseconds;
# ARGV[2]: the request id; ARGV[2 + i]: the limit for KEYS[i].
# Returns {allowed, then per key: remaining, reset_us, retry_us}.
SLIDING_WINDOW_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
local window = tonumber(ARGV[1])
local member = ARGV[2]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local counts = {}
local allowed = 1
for i, key in ipairs(KEYS) do
  -- Drop entries with now - score >= window: the slot comes back exactly one window later.
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - window)
  counts[i] = redis.call('ZCARD', key)
  if counts[i] >= tonumber(ARGV[2 + i]) then allowed = 0 end
end

local out = {allowed}
for i, key in ipairs(KEYS) do
  local limit = tonumber(ARGV[2 + i])
  local count = counts[i]
  if allowed == 1 then
    redis.call('ZADD', key, now, member)
    redis.call('PEXPIRE', key, math.ceil(window / 1000) + 1)
    count = count + 1
  end
  local reset = 0
  local newest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if newest[2] then reset = tonumber(newest[2]) + window - now end
  local retry = 0
  if allowed == 0 and count >= limit then
    local freeing = redis.call('ZRANGE', key, count - limit, count - limit, 'WITHSCORES')
    if freeing[2] then retry = tonumber(freeing[2]) + window - now else retry = window end
  end
  local remaining = limit - count
  if remaining < 0 then remaining = 0 end
  out[#out + 1] = remaining
  out[#out + 1] = reset
  out[#out + 1] = retry
end
return out
"""


def tenant_key(tenant_id: str, prefix: str = KEY_PREFIX) -> str:
    # The {hash tag} puts all of a tenant's keys in one Redis Cluster slot, so
    # one script may touch them together.
    return f"{prefix}{{{tenant_id}}}:all"


def model_key(tenant_id: str, model: str, prefix: str = KEY_PREFIX) -> str:
    return f"{prefix}{{{tenant_id}}}:model:{model}"


class RedisWindow:
    def __init__(
        self,
        client_factory: Callable[[], Redis],
        *,
        timeout_s: float,
        window_seconds: float = WINDOW_SECONDS,
        metrics: RedisMetrics | None = None,
    ) -> None:
        self._client_factory = client_factory
        self._metrics = metrics
        self._client: Redis | None = None
        self._script: Any = None
        self.timeout_s = timeout_s
        self.window_seconds = window_seconds
        self._window_us = round(window_seconds * 1_000_000)
        # Request ids unique across replicas: a random replica tag plus a counter.
        self._id_prefix = os.urandom(6).hex()
        self._ids = itertools.count()

    async def try_acquire(self, key: str, limit: int) -> Decision:
        return (await self.try_acquire_all([(key, limit)]))[0]

    async def try_acquire_all(self, limits: Sequence[tuple[str, int]]) -> list[Decision]:
        """Admit into every key only if every key has room, atomically on the server."""
        if not limits:
            return []
        script = self._get_script()
        keys = [key for key, _ in limits]
        args: list[int | str] = [self._window_us, f"{self._id_prefix}:{next(self._ids):x}"]
        args.extend(limit for _, limit in limits)
        if self._metrics is None:
            reply = await run_script(script, keys, args, self.timeout_s)
        else:
            started = time.perf_counter()
            try:
                reply = await run_script(script, keys, args, self.timeout_s)
            except RedisUnavailable:
                self._metrics.error("rate_window")
                raise
            self._metrics.observe("rate_window", time.perf_counter() - started)
        return self._decisions(reply, limits)

    async def close(self) -> None:
        client, self._client, self._script = self._client, None, None
        if client is not None:
            await client.aclose()

    def _get_script(self) -> Any:
        # Built lazily so the client binds to the running event loop.
        if self._script is None:
            self._client = self._client_factory()
            self._script = self._client.register_script(SLIDING_WINDOW_LUA)
        return self._script

    def _decisions(self, reply: Any, limits: Sequence[tuple[str, int]]) -> list[Decision]:
        return decisions_from_reply(reply, [limit for _, limit in limits])


def decisions_from_reply(reply: Any, limits: Sequence[int]) -> list[Decision]:
    """A window script's reply: allowed, then (remaining, reset µs, retry µs) per limit, in order.
    Anything else is a RedisUnavailable (the store answered, but not as the script does)."""
    try:
        allowed = int(reply[0]) == 1
        out = []
        for i, limit in enumerate(limits):
            remaining, reset_us, retry_us = (int(v) for v in reply[1 + 3 * i : 4 + 3 * i])
            out.append(Decision(allowed=allowed, limit=limit, remaining=remaining,
                                reset_after_s=max(reset_us, 0) / 1_000_000,
                                retry_after_s=max(retry_us, 0) / 1_000_000))
        return out
    except (TypeError, ValueError, IndexError) as exc:
        raise RedisUnavailable(f"unexpected script reply: {exc}") from None


async def run_script(script: Any, keys: list[str], args: list[int | str], timeout_s: float) -> Any:
    """One Lua script call, bounded by `timeout_s`; a timeout or a Redis/socket error is RedisUnavailable."""
    try:
        async with asyncio.timeout(timeout_s):
            return await script(keys=keys, args=args)
    except TimeoutError:
        raise RedisUnavailable(f"no answer within {timeout_s * 1000:.0f} ms") from None
    except (RedisError, OSError) as exc:
        raise RedisUnavailable(f"{type(exc).__name__}: {exc}") from None
