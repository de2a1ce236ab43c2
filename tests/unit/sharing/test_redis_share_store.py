"""The exchange script on a real Redis: write mine, read the others' with their age, forget the old,
and what a stopped and a paused server do to the exchange loop (local view, then back)."""

from __future__ import annotations

import asyncio
import random

from prometheus_client import CollectorRegistry

from modeldock.clock import SystemClock
from modeldock.picking import Picker
from modeldock.redis_client import make_redis_client
from modeldock.sharing.config import SharingConfig
from modeldock.sharing.store import KEY, RedisShareStore
from modeldock.sharing.sync import Sharing
from modeldock.types import Endpoint
from tests.support.redis_server import RedisServer

EP = Endpoint("10.0.0.1", 8000)


async def test_the_script_returns_the_others_with_their_age_and_deletes_the_expired(redis_server: RedisServer) -> None:
    a = RedisShareStore(make_redis_client(redis_server.url, 1.0))
    b = RedisShareStore(make_redis_client(redis_server.url, 1.0))
    try:
        assert await a.exchange("a", b"\x00share|of a", 300) == []
        got = await b.exchange("b", b"B", 300)
        assert [(peer, payload) for peer, _, payload in got] == [("a", b"\x00share|of a")]  # binary-safe
        assert 0 <= got[0][1] < 0.3
        await asyncio.sleep(0.35)
        assert await b.exchange("b", b"B", 300) == []  # a's share is older than the TTL
        raw = make_redis_client(redis_server.url, 1.0)
        assert await raw.hkeys(KEY) == [b"b"]  # ...and deleted, not only skipped
        assert 0 < await raw.pttl(KEY) <= 3000  # the hash outlives its last write by ten TTLs only
        await b.leave("b")
        assert await raw.hkeys(KEY) == []
        await raw.aclose()
    finally:
        await a.close()
        await b.close()


async def test_a_stopped_redis_gives_the_local_view_and_its_return_the_shared_one(redis_server: RedisServer) -> None:
    clock = SystemClock()
    config = SharingConfig(interval_ms=50, ttl_ms=300, timeout_ms=50)
    pickers, sharings = [], []
    for name in ("a", "b"):
        picker = Picker(clock, fallbacks=0, rng=random.Random(1))
        picker.set_endpoints("m", [EP])
        pickers.append(picker)
        store = RedisShareStore(make_redis_client(redis_server.url, 0.05))
        sharings.append(Sharing(picker, store, clock, config, CollectorRegistry(), replica=name))
    a, b = sharings
    try:
        pickers[0].pick("m", cost=100)
        assert await a.exchange() and await b.exchange()
        assert pickers[1].signals(EP).committed == 100
        redis_server.stop()
        deadline = clock.monotonic() + 5
        while b.shared and clock.monotonic() < deadline:
            await b.exchange()
            await asyncio.sleep(0.05)
        assert not b.shared and pickers[1].signals(EP).committed == 0  # the local view, within the TTL or so
        redis_server.start()
        deadline = clock.monotonic() + 5
        while not (await a.exchange() and await b.exchange()) and clock.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert b.shared and pickers[1].signals(EP).committed == 100
    finally:
        for s in sharings:
            await s.stop()


async def test_a_pick_brings_the_next_exchange_forward_but_never_closer_than_the_gap() -> None:
    from modeldock.clock import FakeClock
    from tests.support.share_store import ShareHub

    hub = ShareHub(FakeClock())
    picker = Picker(SystemClock(), fallbacks=0, rng=random.Random(1))
    picker.set_endpoints("m", [EP])
    sharing = Sharing(picker, hub.store(), SystemClock(), SharingConfig(interval_ms=2000, ttl_ms=4000, min_gap_ms=50),
                      CollectorRegistry(), replica="a")
    picker.add_claim_listener(lambda _endpoint: sharing.nudge())
    sharing.start()
    try:
        await asyncio.wait_for(sharing.first.wait(), 2)
        assert hub.exchanges == 1
        for _ in range(5):  # a burst of picks: one exchange soon after, not one each
            picker.pick("m", cost=10)
        await asyncio.sleep(0.3)  # far less than the 2 s interval
        assert hub.exchanges == 2
        assert len(list(hub.shares)) == 1
    finally:
        await sharing.stop()


async def test_every_exchange_is_pushed_to_the_subscribed_peers_and_a_leave_too(redis_server: RedisServer) -> None:
    a = RedisShareStore(make_redis_client(redis_server.url, 1.0, batch=True))
    b = RedisShareStore(make_redis_client(redis_server.url, 1.0, batch=True),
                        make_redis_client(redis_server.url, 1.0, batch=True))
    got: list[tuple[str, bytes]] = []
    subscribed = asyncio.Event()

    async def listen() -> None:
        pushes = b.pushes("b")
        first = asyncio.ensure_future(anext(pushes))
        await asyncio.sleep(0.2)  # subscribed by then (nothing is published before)
        subscribed.set()
        got.append(await first)
        async for push in pushes:
            got.append(push)

    task = asyncio.create_task(listen())
    try:
        async with asyncio.timeout(5):
            await subscribed.wait()
            assert await b.exchange("b", b"B", 1000) == []  # b is a live peer now: pushes go to its channel
            assert await a.exchange("a", b"\x00one|two", 1000, read=False) == []  # binary, "|" inside
            await a.leave("a")
            while len(got) < 2:
                await asyncio.sleep(0.01)
        assert got == [("a", b"\x00one|two"), ("a", b"")]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await a.close()
        await b.close()
