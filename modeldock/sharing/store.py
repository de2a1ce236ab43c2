"""Where replicas meet: one exchange writes this replica's share and reads every live peer's.

`ShareStore` is the narrow interface the sync loop needs; `RedisShareStore` is it on Redis, one
round trip per exchange (a Lua script). A memory store for tests lives in tests/support.

On Redis: one hash, `modeldock:{load}:replicas`, a field per replica holding "<stamp ms>|<share>",
the stamp being Redis's own clock (`TIME`) when written, so no replica's clock is compared with
another's. The script writes the caller's field, returns every other field younger than the TTL with
its age, deletes the older ones (a replica that died is forgotten within the TTL; nothing else needs
to clean up) and keeps the hash itself alive for ten TTLs past the last write. It also publishes the
share on each live peer's channel, `modeldock:{load}:replicas:to:<peer>`: a peer's pick or release
reaches this replica about one Redis hop after that peer's exchange, not at this replica's next one.
One key, declared in KEYS, so it runs unchanged on a Redis Cluster (its hash tag `{load}` is not any tenant's).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from redis.asyncio import Redis

KEY = "modeldock:{load}:replicas"

# KEYS[1] the hash; ARGV: replica, share, ttl in ms, channel prefix, read (1 or 0).
# Returns {peer, age ms, share, ...} when read is 1, else {}. The share is also published to every live
# peer's own channel (prefix .. peer) as "<replica>|<share>", so each takes it in at once
# (`ShareStore.pushes`) rather than at its next exchange, and nobody receives its own.
_EXCHANGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
local read = ARGV[5] == '1'
redis.call('HSET', KEYS[1], ARGV[1], now .. '|' .. ARGV[2])
redis.call('PEXPIRE', KEYS[1], ttl * 10)
local message = ARGV[1] .. '|' .. ARGV[2]
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
      redis.call('PUBLISH', ARGV[4] .. field, message)
      if read then
        out[#out + 1] = field
        out[#out + 1] = now - stamp
        out[#out + 1] = string.sub(value, bar + 1)
      end
    end
  end
end
return out
"""

# KEYS[1] the hash; ARGV: replica, channel prefix. An empty share on a peer's channel: this replica left.
_LEAVE = """
redis.call('HDEL', KEYS[1], ARGV[1])
for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
  redis.call('PUBLISH', ARGV[2] .. field, ARGV[1] .. '|')
end
return 1
"""


class ShareStore(Protocol):
    async def exchange(self, replica: str, share: bytes, ttl_ms: int,
                       read: bool = True) -> list[tuple[str, float, bytes]]:
        """Write `share` as `replica`'s and push it to every live peer; with `read`, every other
        replica's share written within `ttl_ms`, as (replica, age in seconds, share), else []."""
        ...

    async def leave(self, replica: str) -> None:
        """Remove `replica`'s share (a clean shutdown: its peers forget it at once)."""
        ...

    def pushes(self, replica: str) -> AsyncIterator[tuple[str, bytes]]:
        """Every peer's share pushed to `replica`, as (peer, share), as it is written; an empty share
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
        self._channels = key + ":to:"  # + a replica: its pushes (channels, not keys: a PUBLISH reaches every node)
        self._script = client.register_script(_EXCHANGE)
        self._leave = client.register_script(_LEAVE)

    async def exchange(self, replica: str, share: bytes, ttl_ms: int,
                       read: bool = True) -> list[tuple[str, float, bytes]]:
        reply = await self._script(keys=[self._key], args=[replica, share, ttl_ms, self._channels, 1 if read else 0])
        out: list[tuple[str, float, bytes]] = []
        for i in range(0, len(reply) - 2, 3):
            peer, age, payload = reply[i], reply[i + 1], reply[i + 2]
            out.append((peer.decode() if isinstance(peer, bytes) else str(peer), int(age) / 1000.0, bytes(payload)))
        return out

    async def leave(self, replica: str) -> None:
        await self._leave(keys=[self._key], args=[replica, self._channels])

    async def pushes(self, replica: str) -> AsyncIterator[tuple[str, bytes]]:
        pubsub = self._listener.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self._channels + replica)
            while True:
                message = await pubsub.get_message(timeout=None)
                if message is None or message.get("type") != "message":
                    continue
                data = message["data"]
                peer, bar, share = bytes(data).partition(b"|")
                if bar:
                    yield peer.decode(errors="replace"), share
        finally:
            await pubsub.aclose()

    async def close(self) -> None:
        await self._client.aclose()
        if self._listener is not self._client:
            await self._listener.aclose()
