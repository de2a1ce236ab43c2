"""A memory `ShareStore` (modeldock/sharing/store.py) on an injected clock: the Redis script's rules,
for unit and property tests. Every replica's store is a view of one `ShareHub`; the hub can be down
(every exchange fails) and a replica can be partitioned from it (only its exchanges fail).

Pushes: every exchange's share (and a leave) is queued for every other store iterating `pushes()` whose
replica has a share in the hub (as the script publishes to the live peers' channels only), unless the hub
is down or the writer or the reader is partitioned then (a lost push, as on Redis)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from redis.exceptions import ConnectionError as RedisConnectionError

from modeldock.clock import FakeClock


class ShareHub:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.shares: dict[str, tuple[float, bytes]] = {}  # replica -> (written at, share)
        self.down = False
        self.partitioned: set[str] = set()
        self.exchanges = 0
        self.listeners: dict[MemoryShareStore, asyncio.Queue[tuple[str, bytes]]] = {}

    def publish(self, writer: str, share: bytes) -> None:
        if self.down or writer in self.partitioned:
            return
        for store, queue in self.listeners.items():
            if store.replica != writer and store.replica in self.shares and store.replica not in self.partitioned:
                queue.put_nowait((writer, share))

    def store(self) -> MemoryShareStore:
        return MemoryShareStore(self)


class MemoryShareStore:
    def __init__(self, hub: ShareHub) -> None:
        self.hub = hub
        self.replica: str | None = None  # known from its first exchange

    def _check(self, replica: str) -> None:
        if self.hub.down or replica in self.hub.partitioned:
            raise RedisConnectionError("hub unreachable")

    async def exchange(self, replica: str, share: bytes, ttl_ms: int,
                       read: bool = True) -> list[tuple[str, float, bytes]]:
        self._check(replica)
        self.replica = replica
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
        hub.publish(replica, share)
        return out if read else []

    async def leave(self, replica: str) -> None:
        self._check(replica)
        self.hub.shares.pop(replica, None)
        self.hub.publish(replica, b"")

    async def pushes(self, replica: str) -> AsyncIterator[tuple[str, bytes]]:
        if self.hub.down:
            raise RedisConnectionError("hub unreachable")
        self.replica = replica
        queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self.hub.listeners[self] = queue
        try:
            while True:
                yield await queue.get()
        finally:
            del self.hub.listeners[self]

    async def close(self) -> None:
        pass
