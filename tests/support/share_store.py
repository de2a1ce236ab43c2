"""A memory `ShareStore` (modeldock/sharing/store.py) on an injected clock: the Redis script's rules,
for unit and property tests. Every replica's store is a view of one `ShareHub`; the hub can be down
(every exchange fails) and a replica can be partitioned from it (only its exchanges fail)."""

from __future__ import annotations

from redis.exceptions import ConnectionError as RedisConnectionError

from modeldock.clock import FakeClock


class ShareHub:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.shares: dict[str, tuple[float, bytes]] = {}  # replica -> (written at, share)
        self.down = False
        self.partitioned: set[str] = set()
        self.exchanges = 0

    def store(self) -> MemoryShareStore:
        return MemoryShareStore(self)


class MemoryShareStore:
    def __init__(self, hub: ShareHub) -> None:
        self.hub = hub

    def _check(self, replica: str) -> None:
        if self.hub.down or replica in self.hub.partitioned:
            raise RedisConnectionError("hub unreachable")

    async def exchange(self, replica: str, share: bytes, ttl_ms: int) -> list[tuple[str, float, bytes]]:
        self._check(replica)
        hub = self.hub
        hub.exchanges += 1
        now = hub.clock.monotonic()
        hub.shares[replica] = (now, share)
        out = []
        for peer, (at, payload) in list(hub.shares.items()):
            if peer == replica:
                continue
            if (now - at) * 1000 > ttl_ms:
                del hub.shares[peer]  # as the script does: older than the TTL is forgotten
            else:
                out.append((peer, now - at, payload))
        return out

    async def leave(self, replica: str) -> None:
        self._check(replica)
        self.hub.shares.pop(replica, None)

    async def close(self) -> None:
        pass
