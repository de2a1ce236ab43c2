"""Headroom in the director: the standing it passes the picker (a class above, or a tenant served
over its share), the kept tokens sized to protected requests, and the committed tokens returning
to zero on every path a request can take. FakeClock, no gRPC."""

from __future__ import annotations

import asyncio
from typing import Any

from modeldock.config import hash_key
from modeldock.errors import RateLimited
from modeldock.gateway import Routed
from modeldock.picking import Sample
from modeldock.types import Endpoint
from tests.support.gateway_rig import GatewayRig, settle

EP = Endpoint("10.0.0.1", 8000)
OTHER = Endpoint("10.0.0.2", 8000)
TENANTS = {"alice": "standard", "bob": "standard", "ivy": "interactive", "bat": "batch"}


def _config(queue: dict[str, Any]) -> dict[str, Any]:
    return {
        "tenants": [{"id": t, "api_key_hashes": [hash_key(f"k-{t}")], "models": ["m"], "priority": c}
                    for t, c in TENANTS.items()],
        "models": [{"name": "m", "endpoints": [EP.address, OTHER.address]}],
        "queue": queue,
    }


class Rig(GatewayRig):
    """One endpoint of batch limit 2 (learned from two pages with a queue), the other not listed."""

    def __init__(self, **queue: Any) -> None:
        super().__init__(_config(queue), (EP,))
        for waiting in (1.0, 1.0, 0.0):
            self.clock.advance(0.01)
            self.picker.observe(EP, Sample(waiting, 2.0 if waiting else 0.0, 0.1), self.clock.monotonic())

    def route(self, tenant: str, n: int = 0) -> asyncio.Task[Routed]:
        return self.send(f"k-{tenant}", {"model": "m", "prompt": "x" * 40, "max_tokens": 90}, f"{tenant}-{n}")

    def committed(self) -> int:
        """Tokens committed on the model's endpoints by requests in flight."""
        return self.picker.total_committed()


async def test_a_lower_class_leaves_the_last_slot_to_the_top_class() -> None:
    rig = Rig()
    (await rig.route("ivy")).release()  # the top class was seen on the model
    first = await rig.route("bat", 1)
    second = rig.route("bat", 2)
    await settle()
    assert not second.done() and len(rig.gateway.flow.queues) == 1  # one slot of two kept free
    top = await rig.route("ivy", 2)  # ... for this one, at once, past the queued batch request
    assert top.destination.primary == EP and not second.done()
    top.release()  # room again, but batch still leaves the last slot while ivy is recent
    await settle()
    assert not second.done()
    rig.clock.advance(2.5)  # the window passes: batch may use every slot again
    first.release()
    await settle()
    assert second.done()
    (await second).release()
    assert rig.committed() == 0


async def test_a_tenant_over_its_share_leaves_a_slot_for_one_under_it() -> None:
    rig = Rig()
    (await rig.route("bob")).release()  # bob is active on the model
    rig.clock.advance(1.0)  # his tokens served fade (time constant: the 2 s window)
    first = await rig.route("alice", 1)  # nothing of hers served yet: under her share
    second = rig.route("alice", 2)
    await settle()
    assert not second.done()  # alice was served more than bob lately: over her half
    under = await rig.route("bob", 2)  # bob, under his share, takes the last slot
    assert under.destination.primary == EP
    for routed in (first, under):
        routed.release()
    await settle()
    (await second).release()
    assert rig.committed() == 0


async def test_headroom_zero_keeps_the_queue_purely_work_conserving() -> None:
    rig = Rig(headroom=0)
    (await rig.route("ivy")).release()
    held = [await rig.route("bat", i) for i in range(2)]  # both slots for batch
    assert rig.committed() == sum(r.holdings.lease.tokens for r in held) > 0
    for routed in held:
        routed.release()
    assert rig.committed() == 0


async def test_committed_tokens_return_to_zero_on_every_path() -> None:
    rig = Rig(ttl_seconds=1.0, max_wait_seconds=None)
    a = await rig.route("alice", 1)
    b = await rig.route("alice", 2)
    assert rig.committed() == a.holdings.lease.tokens + b.holdings.lease.tokens > 0
    # Cancelled while queued: never counted.
    cancelled = rig.route("alice", 3)
    await settle()
    cancelled.cancel()
    await settle()
    # Rejected: the queue's TTL.
    timed_out = rig.route("alice", 4)
    await settle()
    rig.clock.advance(1.5)
    rig.gateway.flow.dispatch("m")
    await settle()
    assert timed_out.done() and isinstance(timed_out.exception(), RateLimited)
    # Dispatched and cancelled in the same instant: the claim is released once.
    late = rig.route("alice", 5)
    await settle()
    assert not late.done()
    b.release()
    late.cancel()
    await settle()
    assert late.cancelled() and rig.committed() == a.holdings.lease.tokens > 0
    # Retried on another endpoint: the tokens move with the lease.
    rig.gateway.on_endpoints("m", (EP, OTHER))
    before = rig.committed()
    assert a.holdings.lease.move_to(OTHER.address) and rig.committed() == before
    assert rig.picker.committed(OTHER) == before
    outputs = {ep: sum(load.outputs.values()) for ep, load in rig.picker.loads().items()}
    moved = a.holdings.lease
    assert outputs == {EP: 0, OTHER: moved.output} and moved.output == 90  # its output limit moved too
    ends = {ep: list(load.ends) for ep, load in rig.picker.loads().items()}
    assert ends == {EP: [], OTHER: [(moved.output, moved.tokens)]}  # and its entry for the tokens rule
    # Ended, twice (idempotent).
    a.release()
    a.release()
    assert rig.committed() == 0
    assert rig.picker.total_in_flight() == 0
    assert all(not load.outputs and load.new_outputs == 0 and not load.ends and not load.due and not load.running
               for load in rig.picker.loads().values())


async def test_a_protected_request_already_queued_passes_a_head_over_its_share() -> None:
    rig = Rig()
    (await rig.route("bob", 0)).release()  # bob was served first, then alice (she starts at his one)
    (await rig.route("alice", 0)).release()
    first = await rig.route("alice", 1)
    bob = await rig.route("bob", 1)  # bob, served one of four, takes the last slot
    second = rig.route("alice", 2)  # both slots full: queued first
    await settle()
    queued = rig.route("bob", 2)  # bob, served two of five: protected, but no room either
    await settle()
    assert not second.done() and not queued.done() and len(rig.gateway.flow.queues) == 2
    bob.release()  # one slot frees: alice, served three of five, must leave it; bob may take it
    await settle()
    assert queued.done() and not second.done()
    taken = await queued
    assert taken.destination.primary == EP
    first.release()  # room alice may use: her queued head gets it
    await settle()
    assert second.done()
    for routed in (taken, await second):
        routed.release()
    assert rig.committed() == 0


async def test_the_kept_room_is_sized_to_the_protected_requests_seen() -> None:
    rig = Rig(headroom=2)
    (await rig.route("ivy")).release()  # the top class: protected, its cost sampled
    cost = rig.gateway.flow.standing.kept_tokens("m")
    assert cost is not None and cost > 0
    # A lower class must leave two slots, each the size of the protected requests seen.
    assert rig.gateway.flow.headroom("m", "bat", 1.0, 0) == (2, 2 * cost)
    assert rig.gateway.flow.headroom("m", "ivy", 1.0, 2) is None
    # A configured size replaces it.
    fixed = Rig(headroom=1, headroom_tokens=123)
    (await fixed.route("ivy")).release()
    assert fixed.gateway.flow.headroom("m", "bat", 1.0, 0) == (1, 123)


async def test_only_a_protected_request_in_contention_prefers_a_fast_endpoint() -> None:
    rig = Rig()
    (await rig.route("ivy")).release()
    top = rig.gateway.flow.headroom("m", "ivy", 1.0, 2)
    assert not rig.gateway.flow._prefer_fast("m", "ivy", 2, top)  # alone on the model: spaced as usual
    (await rig.route("bat")).release()  # a lower class is active: ivy's room is kept from it
    assert rig.gateway.flow._prefer_fast("m", "ivy", 2, top)
    low = rig.gateway.flow.headroom("m", "bat", 1.0, 0)
    assert low and not rig.gateway.flow._prefer_fast("m", "bat", 0, low)  # it must leave room: no
    off = Rig(headroom=0)
    (await off.route("ivy")).release()
    (await off.route("bat")).release()
    assert not off.gateway.flow._prefer_fast("m", "ivy", 2, None)  # headroom off: nothing is protected


def test_the_models_declared_batch_limit_reaches_the_picker() -> None:
    data = _config({})
    data["models"][0]["max_num_seqs"] = 3
    rig = GatewayRig(data, (EP, OTHER))
    picker = rig.picker
    picker.observe(EP, Sample(0.0, 0.0, 0.1), rig.clock.monotonic())  # no queue ever seen
    assert picker.load(EP).limit == 3
