"""FlowQueue.dispatch's skips: past a head that must leave headroom, to protected flow heads of its
band, which are tried first; and backfill past a protected head only for its own tenant or other
protected ones. FakeClock, no gRPC."""

from __future__ import annotations

import asyncio

from flow_helpers import Harness

from modeldock.errors import Unavailable
from modeldock.flowcontrol import Item, State
from tests.unit.flowcontrol.flow_helpers import waiting


class Room:
    """`free` slots; an unprotected item (tenant in `over`) must leave `headroom` of them."""

    def __init__(self, free: int, over: set[str], headroom: int = 1) -> None:
        self.free = free
        self.over = over
        self.headroom = headroom
        self.order: list[tuple[str, int]] = []
        self.tried: list[tuple[str, int]] = []

    def protected(self, item: Item[int]) -> bool:
        return item.tenant not in self.over

    def claim(self, item: Item[int]) -> int | None:
        self.tried.append((item.tenant, item.seq))
        keep = 0 if self.protected(item) else self.headroom
        if self.free - keep < 1:
            return None
        self.free -= 1
        self.order.append((item.tenant, item.seq))
        return item.seq


def _dispatch(h: Harness, room: Room) -> int:
    return h.queue.dispatch(room.claim, room.protected)


def test_a_protected_request_queued_behind_a_blocked_head_takes_the_kept_slot(
        idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop)
    a1 = h.queue.enqueue(waiting("alice", 100))
    h.queue.enqueue(waiting("alice", 100))
    b1 = h.queue.enqueue(waiting("bob", 100))
    b2 = h.queue.enqueue(waiting("bob", 100))
    room = Room(free=1, over={"alice"})
    assert _dispatch(h, room) == 1
    assert room.order == [("bob", b1.seq)]  # bob's first, FIFO; alice's second never tried
    assert ("alice", a1.seq + 1) not in room.tried
    assert b1.state is State.DISPATCHED and a1.state is State.QUEUED and b2.state is State.QUEUED
    # Room that alice may use too: bob, under his share, goes first all the same (room alice takes
    # is room he waits for); she takes what is left beyond the headroom.
    room.free = 2
    assert _dispatch(h, room) == 1
    assert room.order[1:] == [("bob", b2.seq)]
    room.free = 2
    assert _dispatch(h, room) == 1
    assert room.order[2:] == [("alice", a1.seq)]


def test_without_the_predicate_or_with_a_protected_head_dispatch_stops(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop)
    h.queue.enqueue(waiting("alice", 100))
    h.queue.enqueue(waiting("bob", 100))
    room = Room(free=1, over={"alice"})
    assert h.queue.dispatch(room.claim) == 0  # no predicate: the old rule
    room = Room(free=0, over={"bob"})  # alice, protected, finds no room: nobody may pass her
    assert _dispatch(h, room) == 0
    assert room.tried == [("alice", 1)]


def test_only_protected_heads_of_the_same_band_pass(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop, backfill_seconds=0)  # (backfill would try carol's smaller one too)
    h.queue.enqueue(waiting("alice", 100))
    carol = h.queue.enqueue(waiting("carol", 10))  # small, but over its share too: must not jump alice
    low = h.queue.enqueue(waiting("bob", 100, klass="batch"))  # protected, but of a lower class
    room = Room(free=1, over={"alice", "carol"})
    assert _dispatch(h, room) == 0
    assert ("carol", carol.seq) not in room.tried and ("bob", low.seq) not in room.tried
    assert len(h.queue) == 3


def test_a_rejection_while_skipping_rejects_that_item_and_goes_on(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop)
    h.queue.enqueue(waiting("alice", 100))
    bad = h.queue.enqueue(waiting("bob", 100))
    good = h.queue.enqueue(waiting("dan", 100))
    room = Room(free=1, over={"alice"})

    def claim(item: Item[int]) -> int | None:
        if item is bad:
            raise Unavailable("gone", code="x")
        return room.claim(item)

    assert h.queue.dispatch(claim, room.protected) == 1
    assert bad.state is State.REJECTED and good.state is State.DISPATCHED
    assert h.queue.counts.offered == h.queue.counts.dispatched + h.queue.counts.rejected + len(h.queue)


def test_backfill_past_a_protected_head_takes_no_tenant_over_its_share(
        idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop, backfill_seconds=0.5)
    bob = h.queue.enqueue(waiting("bob", 300))  # under his share, at the head; does not fit
    alice = h.queue.enqueue(waiting("alice", 50))  # over her share: must not take the room bob waits for
    room = Room(free=3, over={"alice"})

    def claim(item: Item[int]) -> int | None:
        return None if item is bob else room.claim(item)

    assert h.queue.dispatch(claim, room.protected) == 0
    assert room.tried == [] and alice.state is State.QUEUED
    small = h.queue.enqueue(waiting("bob", 50))  # his own smaller one may pass him
    assert h.queue.dispatch(claim, room.protected) >= 1
    assert small.state is State.DISPATCHED and bob.state is State.QUEUED
