"""Where replicas meet: one exchange writes this replica's share and reads every live peer's.

`ShareStore` is the narrow interface the sync loop needs; `RedisShareStore` is it on Redis, one
round trip per exchange (a Lua script). A memory store for tests lives in tests/support.

On Redis: one hash, `modeldock:{load}:replicas`, a field per replica holding "<stamp ms>|<share>",
the stamp being Redis's own clock (`TIME`) when written, so no replica's clock is compared with
another's. The script writes the caller's field, returns every other field younger than the TTL with
its age, deletes the older ones (a replica that died is forgotten within the TTL; nothing else needs
to clean up) and keeps the hash itself alive for ten TTLs past the last write. It also publishes the
share on `modeldock:{load}:replicas:pushed`, which every replica subscribes to: a peer's pick or release
reaches this replica about one Redis hop after that peer's exchange, not at this replica's next one.
One key, declared in KEYS, so it runs unchanged on a Redis Cluster (its hash tag `{load}` is not any tenant's).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from redis.asyncio import Redis

KEY = "modeldock:{load}:replicas"

# KEYS[1] the hash; ARGV: replica, share, ttl in ms, channel. Returns {peer, age ms, share, ...}.
# The share is also published on the channel as "<replica>|<share>", so the peers take it in at once
# (`ShareStore.pushes`) rather than at their next exchange.
_EXCHANGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], now .. '|' .. ARGV[2])
redis.call('PEXPIRE', KEYS[1], ttl * 10)
redis.call('PUBLISH', ARGV[4], ARGV[1] .. '|' .. ARGV[2])
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  local field, value = all[i], all[i + 1]
  if field ~= ARGV[1] then
    local bar = string.find(value, '|', 1, true)
    local stamp = bar and tonumber(string.sub(value, 1, bar - 1))
    if stamp == nil or now - stamp > ttl then
      redis.call('HDEL', KEYS[1], field)
    else
      out[#out + 1] = field
      out[#out + 1] = now - stamp
      out[#out + 1] = string.sub(value, bar + 1)
    end
  end
end
return out
"""

# KEYS[1] the hash; ARGV: replica, channel. An empty share on the channel: this replica left.
_LEAVE = """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('PUBLISH', ARGV[2], ARGV[1] .. '|')
return 1
"""


class ShareStore(Protocol):
    async def exchange(self, replica: str, share: bytes, ttl_ms: int) -> list[tuple[str, float, bytes]]:
        """Write `share` as `replica`'s; every other replica's share written within `ttl_ms`, as
        (replica, age in seconds, share)."""
        ...

    async def leave(self, replica: str) -> None:
        """Remove `replica`'s share (a clean shutdown: its peers forget it at once)."""
        ...

    def pushes(self) -> AsyncIterator[tuple[str, bytes]]:
        """Every share written by an exchange, as (replica, share), as it is written; an empty share
        when that replica left. At most once: a push lost with a connection is in the next exchange.
        Raises (RedisError, OSError) when the connection drops; iterate again to resubscribe."""
        ...

    async def close(self) -> None: ...


class RedisShareStore:
    """`client` makes the exchanges; `listener` (no socket timeout: a subscription idles) the pushes."""

    def __init__(self, client: Redis, listener: Redis | None = None, key: str = KEY) -> None:
        self._client = client
        self._listener = listener or client
        self._key = key
        self._channel = key + ":pushed"  # a channel, not a key: on a Redis Cluster a PUBLISH reaches every node
        self._script = client.register_script(_EXCHANGE)
        self._leave = client.register_script(_LEAVE)

    async def exchange(self, replica: str, share: bytes, ttl_ms: int) -> list[tuple[str, float, bytes]]:
        reply = await self._script(keys=[self._key], args=[replica, share, ttl_ms, self._channel])
        out: list[tuple[str, float, bytes]] = []
        for i in range(0, len(reply) - 2, 3):
            peer, age, payload = reply[i], reply[i + 1], reply[i + 2]
            out.append((peer.decode() if isinstance(peer, bytes) else str(peer), int(age) / 1000.0, bytes(payload)))
        return out

    async def leave(self, replica: str) -> None:
        await self._leave(keys=[self._key], args=[replica, self._channel])

    async def pushes(self) -> AsyncIterator[tuple[str, bytes]]:
        pubsub = self._listener.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self._channel)
            while True:
                message = await pubsub.get_message(timeout=None)
                if message is None or message.get("type") != "message":
                    continue
                data = message["data"]
                replica, bar, share = bytes(data).partition(b"|")
                if bar:
                    yield replica.decode(errors="replace"), share
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def close(self) -> None:
        await self._client.aclose()
        if self._listener is not self._client:
            await self._listener.aclose()
