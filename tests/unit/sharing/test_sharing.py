"""Replicas sharing their holdings (modeldock/sharing): what a peer's requests do to this replica's
picking, and what happens when a peer dies, is cut off, or Redis is down. Injected clock, memory store."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry

from modeldock.clock import FakeClock
from modeldock.picking import Picker, Sample, Saturated, Saturation
from modeldock.sharing.config import SharingConfig
from modeldock.sharing.records import ReplicaShare, decode, encode
from modeldock.sharing.sync import Sharing
from modeldock.types import Endpoint
from tests.support.share_store import ShareHub

EP = Endpoint("10.0.0.1", 8000)
EP2 = Endpoint("10.0.0.2", 8000)
CONFIG = SharingConfig(interval_ms=100, ttl_ms=2000, timeout_ms=100)


class Replica:
    def __init__(self, name: str, hub: ShareHub, endpoints: list[Endpoint] | None = None,
                 saturation: Saturation | None = None) -> None:
        self.registry = CollectorRegistry()
        self.picker = Picker(hub.clock, fallbacks=0, rng=random.Random(1), saturation=saturation)
        self.picker.set_endpoints("m", endpoints or [EP])
        self.sharing = Sharing(self.picker, hub.store(), hub.clock, CONFIG, self.registry, replica=name)
        self.rooms: list[str] = []
        self.picker.add_room_listener(self.rooms.append)

    def metric(self, name: str) -> float | None:
        return self.registry.get_sample_value(name)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def hub(clock: FakeClock) -> ShareHub:
    return ShareHub(clock)


async def test_a_peers_requests_count_in_picking_but_not_in_this_replicas_own_counts(hub: ShareHub) -> None:
    a, b = Replica("a", hub), Replica("b", hub)
    a.picker.pick("m", cost=500, output=100)
    assert await a.sharing.exchange() and await b.sharing.exchange()
    s = b.picker.signals(EP)
    assert (s.in_flight, s.committed) == (1, 500)
    assert [tokens for _, tokens in s.ends] == [500]
    assert s.ends[0][0] - s.steps == pytest.approx(100)  # its steps left, on b's step count
    assert b.picker.in_flight(EP) == 0 and b.picker.total_in_flight() == 0  # b's own count and metric
    assert b.metric("modeldock_sharing_peers") == 1 and b.metric("modeldock_sharing_peer_in_flight") == 1
    assert a.picker.signals(EP).in_flight == 1  # a's own, counted once (b has nothing to share back)


async def test_the_room_is_the_pools_a_peer_filled_it_and_this_replica_refuses(hub: ShareHub, clock: FakeClock) -> None:
    room = Saturation(room=True)
    a, b = Replica("a", hub, saturation=room), Replica("b", hub, saturation=room)
    for r in (a, b):
        r.picker.observe(EP, Sample(waiting=0, running=0, kv=0.0, capacity=1000), clock.monotonic())
    a.picker.pick("m", cost=600)
    a.picker.pick("m", cost=300)
    # Without an exchange b sees an idle endpoint and would pile on (what two replicas did before).
    assert b.picker.signals(EP).committed == 0
    await a.sharing.exchange()
    await b.sharing.exchange()
    with pytest.raises(Saturated):
        b.picker.pick("m", cost=600)
    assert b.picker.pick("m", cost=50).primary == EP  # what still fits, fits


async def test_a_peers_picks_after_the_sample_are_new_and_those_before_are_in_it(hub: ShareHub,
                                                                                 clock: FakeClock) -> None:
    a, b = Replica("a", hub), Replica("b", hub)
    a.picker.pick("m", cost=100, output=10)
    clock.advance(0.3)
    b.picker.observe(EP, Sample(waiting=0, running=1, kv=0.1), clock.monotonic())  # shows a's first request
    clock.advance(0.1)
    a.picker.pick("m", cost=200, output=20)  # after b's page: not in it
    await a.sharing.exchange()
    await b.sharing.exchange()
    s = b.picker.signals(EP)
    assert (s.in_flight, s.new_tokens, s.new_outputs) == (2, 200, 20)
    assert (s.running, s.waiting) == (1, 1)  # the new one assumed queued, as a local pick is


async def test_a_dead_peer_is_forgotten_within_the_ttl_and_the_room_it_held_is_heard(hub: ShareHub,
                                                                                      clock: FakeClock) -> None:
    a, b = Replica("a", hub), Replica("b", hub)
    a.picker.pick("m", cost=400)
    await a.sharing.exchange()
    await b.sharing.exchange()
    assert b.picker.signals(EP).in_flight == 1
    b.rooms.clear()
    # a is SIGKILLed: it never exchanges again, and never releases.
    clock.advance(1.9)
    await b.sharing.exchange()
    assert b.picker.signals(EP).in_flight == 1  # within the TTL a slow peer still counts
    clock.advance(0.2)
    await b.sharing.exchange()
    assert b.picker.signals(EP).in_flight == 0 and b.picker.signals(EP).committed == 0
    assert b.rooms == ["m"]  # the queue hears that room appeared
    assert "a" not in hub.shares and b.metric("modeldock_sharing_peers") == 0


async def test_redis_down_keeps_the_last_view_for_the_ttl_then_falls_back_and_recovers(hub: ShareHub,
                                                                                       clock: FakeClock) -> None:
    a, b = Replica("a", hub), Replica("b", hub)
    a.picker.pick("m", cost=400)
    await a.sharing.exchange()
    assert await b.sharing.exchange()
    assert b.metric("modeldock_sharing_shared") == 1
    hub.down = True
    clock.advance(1.0)
    assert not await b.sharing.exchange()
    assert b.picker.signals(EP).in_flight == 1 and b.metric("modeldock_sharing_shared") == 1  # a blip
    clock.advance(1.0)
    assert not await b.sharing.exchange()
    assert b.picker.signals(EP).in_flight == 0 and b.metric("modeldock_sharing_shared") == 0  # local view
    assert b.registry.get_sample_value("modeldock_sharing_exchanges_total", {"outcome": "error"}) == 2
    assert b.picker.pick("m", cost=10).primary == EP  # picking never fails for Redis
    hub.down = False
    await a.sharing.exchange()
    assert await b.sharing.exchange()  # the first good exchange brings the shared view back
    assert b.metric("modeldock_sharing_shared") == 1 and b.picker.signals(EP).in_flight == 2


async def test_a_partitioned_replica_is_forgotten_by_its_peers_and_falls_back_itself(hub: ShareHub,
                                                                                     clock: FakeClock) -> None:
    a, b = Replica("a", hub), Replica("b", hub)
    a.picker.pick("m", cost=100)
    b.picker.pick("m", cost=200)
    for r in (a, b, a):
        await r.sharing.exchange()
    assert a.picker.signals(EP).committed == 300 and b.picker.signals(EP).committed == 300
    hub.partitioned.add("a")
    clock.advance(2.1)
    assert not await a.sharing.exchange()
    assert await b.sharing.exchange()
    assert a.picker.signals(EP).committed == 100 and b.picker.signals(EP).committed == 200
    assert a.metric("modeldock_sharing_shared") == 0 and b.metric("modeldock_sharing_shared") == 1


async def test_a_share_that_does_not_decode_is_skipped_and_counted(hub: ShareHub) -> None:
    a, b = Replica("a", hub), Replica("b", hub)
    a.picker.pick("m", cost=100)
    await a.sharing.exchange()
    hub.shares["junk"] = (hub.clock.monotonic(), b"\x93not a share")
    assert await b.sharing.exchange()
    assert b.picker.signals(EP).committed == 100
    assert b.metric("modeldock_sharing_bad_shares_total") == 1 and b.metric("modeldock_sharing_peers") == 1


async def test_a_clean_stop_takes_the_share_out_at_once(hub: ShareHub) -> None:
    a, b = Replica("a", hub), Replica("b", hub)
    a.picker.pick("m", cost=100)
    await a.sharing.exchange()
    await a.sharing.stop()
    await b.sharing.exchange()
    assert b.picker.signals(EP).in_flight == 0


async def test_holdings_follow_release_and_move_and_are_this_replicas_own_only(hub: ShareHub,
                                                                              clock: FakeClock) -> None:
    a, b = Replica("a", hub, [EP, EP2]), Replica("b", hub, [EP, EP2])
    b.picker.pick("m", cost=70)
    await b.sharing.exchange()
    first = a.picker.pick("m", cost=100, output=8)
    await a.sharing.exchange()
    clock.advance(3.0)  # older than RECENT_SECONDS: counted, no age published
    other = EP2 if first.primary == EP else EP
    assert first.lease.move_to(other.address)
    held = {h.address: h for h in a.picker.holdings()}
    assert list(held) == [other.address]
    assert (held[other.address].in_flight, held[other.address].committed) == (1, 100)
    assert held[other.address].ends and held[other.address].ends[0][1] == 100
    first.lease.release()
    assert a.picker.holdings() == []  # b's 70 tokens are b's to publish, not a's


def test_a_share_round_trips_and_a_malformed_one_is_refused() -> None:
    from modeldock.picking.peers import Holding

    share = ReplicaShare(holdings=(Holding("10.0.0.1:8000", 2, 300, ((0.1, 100, 10),), ((5.0, 100),)),))
    assert decode(encode(share)) == share
    with pytest.raises(Exception, match="Expected"):
        decode(encode(ReplicaShare()).replace(b"\x90", b"\xa1x"))


async def test_standing_travels_with_the_holdings_and_leaves_with_the_fallback(clock: FakeClock) -> None:
    from modeldock.flowcontrol.standing import Standing

    hub = ShareHub(clock)
    standings = {name: Standing(clock, window=5.0, share_window=10.0) for name in ("a", "b")}
    pickers, sharings = {}, {}
    for name in ("a", "b"):
        pickers[name] = Picker(clock, fallbacks=0, rng=random.Random(1))
        pickers[name].set_endpoints("m", [EP])
        sharings[name] = Sharing(pickers[name], hub.store(), clock, CONFIG, CollectorRegistry(), replica=name,
                                 standing=standings[name])
    # A floods through replica a; B sends a little through replica b.
    for _ in range(10):
        standings["a"].seen("m", "A", 1.0, 0)
        standings["a"].served("m", "A", 1000, 1.0)
    standings["b"].seen("m", "B", 1.0, 0)
    standings["b"].served("m", "B", 100, 1.0)
    assert not standings["a"].must_leave_headroom("m", "A", 1.0, 0)  # alone here: all of the share is A's
    await sharings["a"].exchange()
    await sharings["b"].exchange()
    await sharings["a"].exchange()
    assert standings["a"].must_leave_headroom("m", "A", 1.0, 0)  # B, owed half, is seen through replica b
    assert not standings["b"].must_leave_headroom("m", "B", 1.0, 0)
    assert standings["a"].active_weight("m") == 2.0
    hub.down = True
    clock.advance(2.1)
    await sharings["a"].exchange()
    assert not sharings["a"].shared and standings["a"].active_weight("m") == 1.0  # the local view again


async def test_queued_flows_travel_to_the_peers_drain_budget(clock: FakeClock) -> None:
    from modeldock.errors import RateLimited
    from modeldock.flowcontrol import QueueConfig, Waiting
    from modeldock.flowcontrol.dispatcher import Dispatcher

    hub = ShareHub(clock)
    flows, sharings = {}, {}
    for name in ("a", "b"):
        picker = Picker(clock, fallbacks=0, rng=random.Random(1))
        picker.set_endpoints("m", [EP])
        flows[name] = Dispatcher(QueueConfig(), clock, pick=picker.pick, speed=picker.speed)
        sharings[name] = Sharing(picker, hub.store(), clock, CONFIG, CollectorRegistry(), replica=name,
                                 queues=flows[name])
    flows["a"].queues.get("m").enqueue(Waiting(model="m", tenant="t", cost=300, klass="", weight=1.0))
    await sharings["a"].exchange()
    await sharings["b"].exchange()
    assert [(f.tenant, f.tokens) for f in flows["b"].queues.get("m").peer_flows] == [("t", 300)]
    hub.down = True
    clock.advance(2.1)
    await sharings["b"].exchange()
    assert flows["b"].queues.get("m").peer_flows == ()  # the local view again
    flows["a"].queues.get("m").reject_all(RateLimited("test over", code="queue_full"))


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_peers_pick_and_release_are_pushed_into_the_view_before_this_replicas_next_exchange(
        hub: ShareHub) -> None:
    a, b = Replica("a", hub), Replica("b", hub)
    assert await b.sharing.exchange()
    listening = asyncio.create_task(b.sharing.listen())
    try:
        await _settle()
        lease = a.picker.pick("m", cost=500).lease
        await a.sharing.exchange()
        await _settle()
        assert b.picker.signals(EP).committed == 500  # no exchange of b's own since the pick
        assert b.metric("modeldock_sharing_pushes_total") == 1
        b.rooms.clear()
        lease.release()
        await a.sharing.exchange()
        await _settle()
        assert b.picker.signals(EP).in_flight == 0 and b.rooms == ["m"]  # the room is heard at once
        a.picker.pick("m", cost=70)
        await a.sharing.exchange()
        await a.sharing.stop()  # a clean stop is pushed too: forgotten without waiting for the TTL
        await _settle()
        assert b.picker.signals(EP).committed == 0 and b.metric("modeldock_sharing_peers") == 0
    finally:
        listening.cancel()
        await asyncio.gather(listening, return_exceptions=True)


async def test_an_older_share_arriving_after_a_newer_push_is_not_taken(hub: ShareHub) -> None:
    a, b = Replica("a", hub), Replica("b", hub)
    a.picker.pick("m", cost=100)
    await a.sharing.exchange()
    old = hub.shares["a"][1]
    a.picker.pick("m", cost=200)
    await a.sharing.exchange()
    b.sharing.pushed("a", hub.shares["a"][1])  # the newer one, pushed first
    assert b.picker.signals(EP).committed == 0  # b has no shared view before its first exchange...
    hub.shares["a"] = (hub.clock.monotonic(), old)  # ...whose reply carries the older share
    assert await b.sharing.exchange()
    assert b.picker.signals(EP).committed == 300
    b.sharing.pushed("a", b"\x93junk")
    assert b.picker.signals(EP).committed == 300 and b.metric("modeldock_sharing_bad_shares_total") == 1


async def test_a_lost_push_is_filled_by_the_next_exchange(hub: ShareHub, clock: FakeClock) -> None:
    a, b = Replica("a", hub), Replica("b", hub)
    assert await b.sharing.exchange()
    listening = asyncio.create_task(b.sharing.listen())
    try:
        await _settle()
        hub.partitioned.add("b")  # b's subscription loses what is published now
        a.picker.pick("m", cost=400)
        await a.sharing.exchange()
        await _settle()
        assert b.picker.signals(EP).committed == 0
        hub.partitioned.clear()
        assert await b.sharing.exchange()
        assert b.picker.signals(EP).committed == 400
    finally:
        listening.cancel()
        await asyncio.gather(listening, return_exceptions=True)


async def test_a_pick_is_pushed_at_once_only_where_a_peers_decision_can_turn_on_it(hub: ShareHub,
                                                                                    clock: FakeClock) -> None:
    a = Replica("a", hub)
    a.picker.observe(EP, Sample(waiting=0, running=0, kv=0.0, capacity=1000), clock.monotonic())
    lease = a.picker.pick("m", cost=100).lease
    a.sharing.changed(EP)
    assert not a.sharing._wake.is_set()  # a tenth full: the next interval's exchange tells the peers
    a.picker.pick("m", cost=450)
    a.sharing.changed(EP)
    assert a.sharing._wake.is_set()  # over half full: at once
    a.sharing._wake.clear()
    a.sharing._peers_queue = True  # as after a share with queued requests
    lease.release()
    a.sharing.changed(EP)
    assert a.sharing._wake.is_set()


async def test_constant_nudges_still_read_every_interval(hub: ShareHub) -> None:
    a = Replica("a", hub)
    reads: list[bool] = []
    store = a.sharing._store
    real = store.exchange

    async def counting(replica: str, share: bytes, ttl_ms: int, read: bool = True) -> list[tuple[str, float, bytes]]:
        reads.append(read)
        return await real(replica, share, ttl_ms, read)

    store.exchange = counting  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    began = loop.time()
    task = asyncio.create_task(a.sharing.run())
    try:
        for _ in range(40):  # a change every 10 ms: every wait ends by a nudge
            a.sharing.nudge()
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    intervals = (loop.time() - began) / a.sharing.interval
    # A read per interval (the first at once), the rest write-only.
    assert len(reads) > 2 * intervals and intervals - 1 <= sum(reads) <= intervals + 2


def test_a_peers_steps_left_counted_to_a_later_page_are_moved_to_this_replicas_count(clock: FakeClock) -> None:
    from modeldock.picking.peers import Holding, PeerLoad

    picker = Picker(clock, fallbacks=0, rng=random.Random(1))
    picker.set_endpoints("m", [EP])
    picker.observe(EP, Sample(waiting=0, running=2, kv=0.1, capacity=1000, generated_total=0), clock.monotonic())
    clock.advance(1.0)
    picker.observe(EP, Sample(waiting=0, running=2, kv=0.1, capacity=1000, generated_total=40), clock.monotonic())
    load = picker.load(EP)
    assert load.step_rate == pytest.approx(20.0)  # 40 tokens over 2 sequences: 20 steps in the second
    clock.advance(0.5)
    now = clock.monotonic()
    # A peer whose page was read 0.5 s after this replica's: 10 steps left then, 20 more here.
    later, earlier = PeerLoad(), PeerLoad()
    later.add(Holding(EP.address, 1, 100, (), ((10.0, 100),), page_age=0.0), now, age=0.0)
    picker.set_peers({EP.address: later})
    assert [end - load.steps for end, _ in picker.signals(EP).ends] == [pytest.approx(20.0)]
    # One read before this replica's: kept as published (it looks later than it is: the safe side).
    earlier.add(Holding(EP.address, 1, 100, (), ((10.0, 100),), page_age=0.8), now, age=0.0)
    picker.set_peers({EP.address: earlier})
    assert [end - load.steps for end, _ in picker.signals(EP).ends] == [pytest.approx(10.0)]


async def test_a_peers_request_on_its_way_when_the_page_was_read_still_counts(hub: ShareHub,
                                                                             clock: FakeClock) -> None:
    a, b = Replica("a", hub), Replica("b", hub)
    a.picker.pick("m", cost=100, output=10)
    a.picker.pick("m", cost=100, output=10)
    clock.advance(0.01)
    # Read just after a sent both: one has not reached the backend yet, so the page shows one.
    b.picker.observe(EP, Sample(waiting=0, running=1, kv=0.1), clock.monotonic())
    await a.sharing.exchange()
    await b.sharing.exchange()
    s = b.picker.signals(EP)
    assert s.in_flight == 2
    assert (s.running, s.waiting) == (1, 1)  # the one the page missed is queued, not a free slot
    b.picker.observe(EP, Sample(waiting=0, running=2, kv=0.2), clock.monotonic())  # it arrived
    s = b.picker.signals(EP)
    assert (s.running, s.waiting) == (2, 0)  # counted once
