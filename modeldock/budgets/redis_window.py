"""The token window shared by all replicas, kept in Redis.

Same semantics as `window.TokenWindow`. Each window is two keys in the
tenant's hash slot: a sorted set (member: reservation id, score: the Redis
server's time in microseconds) and a hash (reservation id -> amount, plus the
running total under `~total`). Reserving is one Lua script: prune every window,
check that the cost fits all of them, then add to all or none (up to `want`: a
lease, lease.py). Settling is a
second script that sets the amount (absolute, so a resent call cannot count
twice) in every window that still holds the reservation.

Failures raise `RedisUnavailable` (from redis_window), bounded by `timeout_s`. Calls go through
one `RedisBatch` per window (one client): see redis_batch.py and README.md ("Token budgets").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from redis.asyncio import Redis

from modeldock.admission.redis_window import decisions_from_reply
from modeldock.admission.window import Decision
from modeldock.budgets.redis_batch import FLUSH_INTERVAL_S, CallLater, OnError, RedisBatch, Script
from modeldock.budgets.window import UNIT, BudgetLimit, Shape
from modeldock.redis_client import RedisUnavailable
from modeldock.redis_metrics import RedisMetrics

KEY_PREFIX = "modeldock:tb:"

# Shared by both scripts: `now` from ARGV (tests) or the server's TIME, and a
# prune that drops entries with now - score >= window and subtracts their amounts.
_COMMON_LUA = """
if redis.replicate_commands then redis.replicate_commands() end
local now
if ARGV[3] ~= '' then now = tonumber(ARGV[3]) else
  local t = redis.call('TIME'); now = tonumber(t[1]) * 1000000 + tonumber(t[2]) end
local function prune(z, h, window)
  -- In batches: unpack() has a stack limit, and a day window can expire many entries at once.
  while true do
    local old = redis.call('ZRANGEBYSCORE', z, '-inf', now - window, 'LIMIT', 0, 1000)
    if #old == 0 then break end
    local amounts = redis.call('HMGET', h, unpack(old))
    local gone = 0
    for i = 1, #old do gone = gone + (tonumber(amounts[i]) or 0) end
    redis.call('HDEL', h, unpack(old))
    redis.call('HINCRBY', h, '~total', -gone)
    redis.call('ZREM', z, unpack(old))
  end
  return tonumber(redis.call('HGET', h, '~total') or '0')
end
"""

# KEYS: per window a sorted set and its hash. ARGV[1]: reservation id; ARGV[2]:
# the least grant that must fit; ARGV[3]: now in µs or ''; ARGV[4]: want (>= the least);
# then per window: window µs, limit; then, optionally, per window: base, slope (the window counts
# ceil(base + slope * g) for a grant g; absent: g itself). A negative window is a calendar period's
# counter (period.py): no pruning, no sorted set, the hash lives -window µs after its last
# reservation. Admits when the least fits every window and adds the largest g <= want that fits all
# under the id (a lease, or a request's output capped to its budget; want = the least for one exact
# request). An id already present is not added again and the grant it holds is returned (a resent
# call). Returns {allowed, then per window: remaining, reset_us, retry_us, then g (0 when refused)}.
RESERVE_LUA = (
    _COMMON_LUA
    + """
local id, cost, want = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4])
if want < cost then want = cost end
local n = #KEYS / 2
local shaped = #ARGV >= 4 + 4 * n
local function amount(i, g)
  if not shaped then return g end
  local base, slope = tonumber(ARGV[3 + 2 * n + 2 * i]), tonumber(ARGV[4 + 2 * n + 2 * i])
  if base == 0 and slope == 1 then return g end
  local a = math.ceil(base + slope * g - 1e-9)
  if a < 0 then a = 0 end
  return a
end
local function most(i, room, g)
  if shaped then
    local base, slope = tonumber(ARGV[3 + 2 * n + 2 * i]), tonumber(ARGV[4 + 2 * n + 2 * i])
    if not (base == 0 and slope == 1) then
      if slope <= 0 then
        if amount(i, 0) <= room then return g end
        return -1
      end
      local m = math.floor((room - base + 1e-9) / slope)
      while m >= 0 and amount(i, m) > room do m = m - 1 end
      if m < g then return m end
      return g
    end
  end
  if room < g then return room end
  return g
end
local used, allowed = {}, 1
local stored = redis.call('HGET', KEYS[2], id)
local again = stored ~= false
local grant = want
for i = 1, n do
  local window = tonumber(ARGV[3 + 2 * i])
  if window >= 0 then used[i] = prune(KEYS[2 * i - 1], KEYS[2 * i], window)
  else used[i] = tonumber(redis.call('HGET', KEYS[2 * i], '~total') or '0') end
  if not again then grant = most(i, tonumber(ARGV[4 + 2 * i]) - used[i], grant) end
end
if again then grant = most(1, tonumber(stored), want)
elseif grant < cost then allowed = 0; grant = 0 end
local out = {allowed}
for i = 1, n do
  local z, h = KEYS[2 * i - 1], KEYS[2 * i]
  local window, limit = tonumber(ARGV[3 + 2 * i]), tonumber(ARGV[4 + 2 * i])
  if allowed == 1 and not again then
    local a = amount(i, grant)
    redis.call('HSET', h, id, a)
    used[i] = redis.call('HINCRBY', h, '~total', a)
    if window >= 0 then
      redis.call('ZADD', z, now, id)
      local ttl = math.ceil(window / 1000) + 1
      redis.call('PEXPIRE', z, ttl)
      redis.call('PEXPIRE', h, ttl)
    else
      redis.call('PEXPIRE', h, math.ceil(-window / 1000))
    end
  end
  local reset, retry = 0, 0
  local need = amount(i, cost)
  if window >= 0 then
    local newest = redis.call('ZRANGE', z, -1, -1, 'WITHSCORES')
    if newest[2] then reset = tonumber(newest[2]) + window - now end
    if allowed == 0 and used[i] + need > limit then
      retry = window
      local entries = redis.call('ZRANGE', z, 0, -1, 'WITHSCORES')
      local freed = 0
      for j = 1, #entries, 2 do
        freed = freed + (tonumber(redis.call('HGET', h, entries[j])) or 0)
        if used[i] - freed + need <= limit then retry = tonumber(entries[j + 1]) + window - now; break end
      end
    end
  end
  local remaining = limit - used[i]
  if remaining < 0 then remaining = 0 end
  out[#out + 1] = remaining
  out[#out + 1] = reset
  out[#out + 1] = retry
end
out[#out + 1] = grant
return out
"""
)

# KEYS as above. ARGV[1]: reservation id; ARGV[2]: the settled amount (0 removes
# the entry); ARGV[3]: now or ''; then per window: window µs; then, optionally, per window its own
# amount (cost windows count money, token windows tokens) and a final flag ('1': a counter's entry is
# folded into its total: no later settlement will change it). Returns windows changed.
SETTLE_LUA = (
    _COMMON_LUA
    + """
local id = ARGV[1]
local n = #KEYS / 2
local final = ARGV[4 + 2 * n] == '1'
local changed = 0
for i = 1, n do
  local z, h = KEYS[2 * i - 1], KEYS[2 * i]
  local window = tonumber(ARGV[3 + i])
  local amount = tonumber(ARGV[3 + n + i] or ARGV[2])
  if window >= 0 then prune(z, h, window) end
  local old = redis.call('HGET', h, id)
  if old then
    redis.call('HINCRBY', h, '~total', amount - tonumber(old))
    if amount == 0 or (final and window < 0) then
      redis.call('HDEL', h, id)
      if window >= 0 then redis.call('ZREM', z, id) end
    else
      redis.call('HSET', h, id, amount)
    end
    changed = changed + 1
  end
end
return changed
"""
)


def budget_key(tenant_id: str, name: str, prefix: str = KEY_PREFIX) -> str:
    """A window's sorted-set key; `name` is `minute`, `day` or `minute:model:<pattern>`."""
    return f"{prefix}{{{tenant_id}}}:{name}"


class RedisTokenWindow:
    """The shared window, its calls batched per Redis client (`redis_batch.RedisBatch`): reserves are
    awaited (coalesced when concurrent), settlements are queued and flushed every few ms."""

    def __init__(
        self,
        client_factory: Callable[[], Redis],
        *,
        timeout_s: float,
        now_us: Callable[[], int] | None = None,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        call_later: CallLater | None = None,
        metrics: RedisMetrics | None = None,
    ) -> None:
        """`now_us` replaces the Redis server's clock (tests only); None uses `TIME` on the server."""
        self._metrics = metrics
        self._batch = RedisBatch(
            client_factory, timeout_s=timeout_s, flush_interval_s=flush_interval_s, call_later=call_later
        )
        self.timeout_s = timeout_s
        self._now_us = now_us

    @property
    def batch(self) -> RedisBatch:
        return self._batch

    async def reserve_up_to(
        self, entry_id: str, cost: int, want: int, limits: Sequence[BudgetLimit],
        shapes: Sequence[Shape] | None = None,
    ) -> tuple[list[Decision], int]:
        """Admit when the grant `cost` fits every window and add the largest grant <= `want` that fits
        all under `entry_id` (each window counting its shape of it; default the grant itself): the
        decisions (remaining after the whole grant) and the grant (0 when refused; a resent call returns
        the grant the first stored)."""
        if not limits:
            return [], 0
        args: list[int | str] = [entry_id, cost, self._now_arg(), max(want, cost)]
        for _, limit, window in limits:
            args.extend((_us(window), limit))
        if shapes is not None and any(shape != UNIT for shape in shapes):  # (0, 1.0) == (0.0, 1.0) too
            for base, slope in shapes:
                args.extend((repr(float(base)), repr(float(slope))))
        reply = await self._call("token_reserve", _RESERVE, _keys(key for key, _, _ in limits), args)
        decisions = decisions_from_reply(reply, [limit for _, limit, _ in limits])
        try:
            grant = int(reply[1 + 3 * len(limits)])
        except (TypeError, ValueError, IndexError) as exc:
            raise RedisUnavailable(f"unexpected script reply: {exc}") from None
        return decisions, grant

    async def settle(
        self, entry_id: str, keys: Sequence[tuple[str, float]], amount: int | Sequence[int], *, final: bool = False
    ) -> int:
        """Settle now and return the number of windows changed."""
        if not keys:
            return 0
        reply = await self._call("token_settle", _SETTLE, *self._settle_call(entry_id, keys, amount, final))
        try:
            return int(reply)
        except (TypeError, ValueError) as exc:
            raise RedisUnavailable(f"unexpected script reply: {exc}") from None

    def settle_later(
        self, entry_id: str, keys: Sequence[tuple[str, float]], amount: int | Sequence[int], on_error: OnError,
        *, final: bool = False,
    ) -> asyncio.Future[None]:
        """Queue the settlement for the next flush; the future is done once Redis took it or it failed.
        `amount`: one for every window, or one per window; `final`: no later settlement of this id will
        come (a period counter then folds the entry into its total)."""
        if self._metrics is not None:
            metrics, told = self._metrics, on_error

            def on_error(exc: RedisUnavailable) -> None:
                metrics.error("token_settle")
                told(exc)

        return self._batch.defer(_SETTLE, *self._settle_call(entry_id, keys, amount, final), on_error)

    async def _call(self, op: str, script: Script, keys: Sequence[str], args: Sequence[int | str]) -> Any:
        if self._metrics is None:
            return await self._batch.call(script, keys, args)
        started = time.perf_counter()
        try:
            reply = await self._batch.call(script, keys, args)
        except RedisUnavailable:
            self._metrics.error(op)
            raise
        self._metrics.observe(op, time.perf_counter() - started)
        return reply

    async def close(self) -> None:
        """Flush queued settlements (bounded by `timeout_s`) and close the client."""
        await self._batch.close()

    def _settle_call(
        self, entry_id: str, keys: Sequence[tuple[str, float]], amount: int | Sequence[int], final: bool
    ) -> tuple[list[str], list[int | str]]:
        first = amount if isinstance(amount, int) else amount[0]
        args: list[int | str] = [entry_id, first, self._now_arg(), *(_us(window) for _, window in keys)]
        if not isinstance(amount, int) or final:
            args.extend([amount] * len(keys) if isinstance(amount, int) else amount)
        if final:
            args.append("1")
        return _keys(key for key, _ in keys), args

    def _now_arg(self) -> int | str:
        return self._now_us() if self._now_us is not None else ""


_RESERVE = Script(RESERVE_LUA)
_SETTLE = Script(SETTLE_LUA)


def _keys(zset_keys: Iterable[str]) -> list[str]:
    out: list[str] = []
    for key in zset_keys:
        out.extend((key, key + ":amt"))
    return out


def _us(seconds: float) -> int:
    return round(seconds * 1_000_000)
