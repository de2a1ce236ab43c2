"""Which replica's queued request takes the pool's room first (flowcontrol/pool_order.py): FIFO within a
tenant across replicas, a quiet tenant's head ahead of the flood's, and a bounded yield. Two whole
replicas (picker, dispatcher, sharing) over one memory store, an injected clock and manual timers."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry

from modeldock.clock import FakeClock
from modeldock.flowcontrol import QueueConfig, Waiting
from modeldock.flowcontrol.dispatcher import Dispatcher
from modeldock.flowcontrol.pool_order import SLACK_SECONDS, peer_first
from modeldock.flowcontrol.queue_share import QueuedFlow
from modeldock.picking import Pick, Picker, Sample, Saturation
from modeldock.sharing.config import SharingConfig
from modeldock.sharing.sync import Sharing
from modeldock.types import Endpoint
from tests.support.manual_timers import ManualTimers
from tests.support.share_store import ShareHub

EP = Endpoint("10.0.0.1", 8000)
CONFIG = SharingConfig(interval_ms=100, ttl_ms=2000, timeout_ms=100)


def test_peer_first_is_one_queues_order() -> None:
    def first(flow: QueuedFlow, *, tenant: str = "t", priority: int = 1, protected: bool = False) -> bool:
        return peer_first([flow], tenant, priority, enqueued_at=10.0, applied_at=10.0, protected=protected)

    assert first(QueuedFlow("m", 2, "x", 1.0, 10, waited=0.0))  # a higher class, even younger
    assert not first(QueuedFlow("m", 0, "x", 1.0, 10, waited=9.0))  # a lower class, even older
    assert first(QueuedFlow("m", 1, "t", 1.0, 10, waited=0.5))  # its own tenant, older: FIFO
    assert not first(QueuedFlow("m", 1, "t", 1.0, 10, waited=SLACK_SECONDS / 2))  # as old, within the estimate
    assert first(QueuedFlow("m", 1, "x", 1.0, 10, waited=0.5))  # another tenant's older head...
    assert not first(QueuedFlow("m", 1, "x", 1.0, 10, waited=0.5), protected=True)  # ...unless this one is owed


class Replica:
    def __init__(self, name: str, hub: ShareHub, timers: ManualTimers) -> None:
        clock = hub.clock
        self.picker = Picker(clock, fallbacks=0, rng=random.Random(1), saturation=Saturation(room=True))
        self.picker.set_endpoints("m", [EP])
        self.picker.observe(EP, Sample(waiting=0, running=0, kv=0.0, capacity=1000), clock.monotonic())
        self.flow = Dispatcher(QueueConfig(headroom=0), clock, pick=self.picker.pick, speed=lambda _m: 1000.0,
                               call_later=timers.call_later)
        self.picker.add_room_listener(self.flow.dispatch)
        self.sharing = Sharing(self.picker, hub.store(), clock, CONFIG, CollectorRegistry(), replica=name,
                               standing=self.flow.standing, queues=self.flow)
        self.sharing.shared = True  # as after a first exchange: pushes apply at once

    async def send(self, tenant: str, cost: int = 400) -> asyncio.Task[Pick]:
        """The request's task, once it has picked or queued."""
        task = asyncio.ensure_future(self.flow.acquire(Waiting(model="m", tenant=tenant, cost=cost, klass="",
                                                               weight=1.0)))
        await _settle()
        return task


async def _settle() -> None:
    for _ in range(40):  # a push's delivery, the dispatch it makes and the waiter's wake-up
        await asyncio.sleep(0)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def _pool(clock: FakeClock) -> tuple[ShareHub, ManualTimers, Replica, Replica, list[asyncio.Task[None]]]:
    hub, timers = ShareHub(clock), ManualTimers()
    a, b = Replica("a", hub, timers), Replica("b", hub, timers)
    listeners = [asyncio.ensure_future(r.sharing.listen()) for r in (a, b)]
    await _settle()
    await _exchange(a, b)  # each is a live peer of the other (as a replica is before it reports ready)
    return hub, timers, a, b, listeners


async def _exchange(*replicas: Replica) -> None:
    for r in replicas:
        assert await r.sharing.exchange()
    await _settle()


async def test_a_request_here_waits_behind_the_same_tenants_older_head_on_a_peer(clock: FakeClock) -> None:
    hub, timers, a, b, listeners = await _pool(clock)
    try:
        mine = await a.send("t")
        await _exchange(a)
        theirs = await b.send("t")  # 800 of the pool's 1,000 tokens
        await _exchange(b)
        older = await a.send("t")  # queued on a
        await _exchange(a)
        clock.advance(0.1)
        theirs.result().lease.release()  # room, seen on b first
        newer = await b.send("t")  # b has nobody queued, but a's head is older: it waits behind it
        assert not newer.done()
        await _exchange(b)  # a hears of the room: its head takes it
        assert older.done() and not newer.done()
        await _exchange(a)  # a's head is gone from its queue: b's yielding request is tried again, soon
        assert timers.fire()
        await _settle()
        assert not newer.done()  # the room b saw is a's now
        mine.result().lease.release()
        await _exchange(a)
        assert newer.done() and newer.result().primary == EP
    finally:
        for task in listeners:
            task.cancel()
        await asyncio.gather(*listeners, return_exceptions=True)


async def test_room_on_this_replica_goes_to_a_peers_older_head_and_the_yield_is_bounded(clock: FakeClock) -> None:
    hub, timers, a, b, listeners = await _pool(clock)
    try:
        held = [await a.send("t"), await a.send("t")]
        await _settle()
        await _exchange(a)  # b hears of a's holdings: nothing more fits
        first = await b.send("t")  # queued on b
        await _exchange(b)
        clock.advance(0.1)
        second = await a.send("t")  # queued on a, younger than b's head
        await _exchange(a)
        held[0].result().lease.release()  # the room appears on a, but b's head is older
        await _settle()
        assert not second.done() and timers.armed  # a yields, with a retry at the bound
        await _exchange(a)  # the release reaches b by the push: b's head takes the room
        assert first.done() and not second.done()
        timers.fire()  # a's retry: no room now, it stays queued
        await _settle()
        assert not second.done()

    finally:
        for task in listeners:
            task.cancel()
        await asyncio.gather(*listeners, return_exceptions=True)


async def test_a_peer_that_does_not_take_the_room_has_it_for_the_hold_only(clock: FakeClock) -> None:
    hub, timers, a, b, listeners = await _pool(clock)
    try:
        held = [await a.send("t"), await a.send("t")]
        await _settle()
        await _exchange(a)
        older = await b.send("t")
        await _exchange(b)
        clock.advance(0.1)
        younger = await a.send("t")
        await _exchange(a)
        hub.partitioned.add("b")  # b hears nothing more: it cannot take the room a sees
        held[0].result().lease.release()
        await _settle()
        assert not younger.done() and not older.done()
        clock.advance(0.02)
        timers.fire()  # a retry before the bound: still yielding
        await _settle()
        assert not younger.done()
        clock.advance(a.flow.order.hold)
        timers.fire()
        await _settle()
        assert younger.done() and younger.result().primary == EP  # the room is not left idle for long
        assert not older.done()
        older.cancel()
    finally:
        for task in listeners:
            task.cancel()
        await asyncio.gather(*listeners, return_exceptions=True)


async def test_a_quiet_tenant_is_not_held_behind_the_floods_older_heads(clock: FakeClock) -> None:
    hub, timers, a, b, listeners = await _pool(clock)
    try:
        # A floods through a; its requests queue (older). B, under its share, arrives through b.
        for r in (a, b):
            r.flow.standing.seen("m", "A", 1.0, 1)
            r.flow.standing.seen("m", "B", 1.0, 1)
        full = [await a.send("A"), await a.send("A")]
        await _settle()
        flood = [await a.send("A") for _ in range(3)]
        await _exchange(a, b)
        clock.advance(0.5)
        await _exchange(a, b)
        quiet = await b.send("B", cost=100)  # fits in the room left: taken at once, A's older heads or not
        await _settle()
        assert quiet.done() and all(t.done() for t in full) and not any(t.done() for t in flood)
        for t in flood:
            t.cancel()
    finally:
        for task in listeners:
            task.cancel()
        await asyncio.gather(*listeners, return_exceptions=True)


def test_a_larger_peer_head_is_passed_while_it_may_be_backfilled_past() -> None:
    big = QueuedFlow("m", 1, "t", 1.0, 900, waited=0.5, head=900)
    # A request of 100 queued at 10.0; the peer's head of 900 was queued at 9.5 (applied at 10.0).
    assert not peer_first([big], "t", 1, 10.0, 10.0, False, cost=100, backfill_seconds=1.0, now=10.0)
    assert peer_first([big], "t", 1, 10.0, 10.0, False, cost=100, backfill_seconds=1.0, now=10.6)  # waited 1.1 s
    assert peer_first([big], "t", 1, 10.0, 10.0, False, cost=900, backfill_seconds=1.0, now=10.0)  # no larger
