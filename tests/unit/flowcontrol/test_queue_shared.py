"""The drain budget across replicas: the pool drains every replica's queue, so the tokens ahead of a
new request include the peers' queued flows (flowcontrol/queue_share.py), as fair queueing orders them."""

from __future__ import annotations

import asyncio

import pytest
from flow_helpers import Harness, waiting

from modeldock.errors import RateLimited
from modeldock.flowcontrol.queue_share import QueuedFlow, peer_ahead


def test_the_peers_queue_of_the_same_tenant_counts_ahead(idle_loop: asyncio.AbstractEventLoop) -> None:
    # 500 tokens/s for 0.5 s: 250 may be ahead. Here 100; the peer replica holds 200 more of the same tenant.
    h = Harness(idle_loop, max_length=1000, max_wait_seconds=0.5, drain_rate=lambda: 500.0)
    h.queue.enqueue(waiting("a", 100))
    h.queue.enqueue(waiting("a", 100))  # alone: 100 ahead, it waits
    h.queue.peer_flows = (QueuedFlow("m", 1, "a", 1.0, 200),)
    with pytest.raises(RateLimited, match="would not drain"):
        h.queue.enqueue(waiting("a", 100))  # 200 here + 200 there
    h.queue.peer_flows = ()
    h.queue.enqueue(waiting("a", 40))  # the local view alone: 200 ahead, it fits


def test_a_flood_queued_on_a_peer_does_not_shed_a_quiet_tenant_here(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop, max_length=1000, max_wait_seconds=0.5, drain_rate=lambda: 500.0)
    h.queue.enqueue(waiting("b", 100))
    h.queue.peer_flows = (QueuedFlow("m", 1, "a", 1.0, 10_000),)  # A floods through the other replica
    h.queue.enqueue(waiting("b", 100))  # fair order: A's flood is ahead by B's 100 only
    h.queue.peer_flows = (QueuedFlow("m", 2, "x", 1.0, 300),)  # a higher class queued elsewhere: all ahead
    with pytest.raises(RateLimited):
        h.queue.enqueue(waiting("b", 10))


def test_peer_ahead_is_fair_queueing_over_the_peers_flows() -> None:
    flows = [QueuedFlow("m", 1, "a", 1.0, 1000), QueuedFlow("m", 1, "c", 2.0, 50), QueuedFlow("m", 0, "z", 1.0, 999),
             QueuedFlow("m", 1, "b", 1.0, 30)]
    # b (weight 1) with 100 queued here: a is ahead by 100 (its weight x b's virtual time), c by at most its 50,
    # b's own 30 on the peer in full, the lower class not at all.
    assert peer_ahead(flows, "b", 1, 1.0, 100.0) == 100 + 50 + 30
    assert peer_ahead(flows, "b", 1, 1.0, 0.0) == 30


def test_the_budget_applies_to_an_empty_queue_here_when_a_peers_has_waited(
        idle_loop: asyncio.AbstractEventLoop) -> None:
    # 500 tokens/s for 0.5 s: 250 may be ahead; the peer holds 400 of the same tenant. Nothing queued here.
    h = Harness(idle_loop, max_length=1000, max_wait_seconds=0.5, drain_rate=lambda: 500.0, shed_after=0.5)
    h.queue.peer_flows, h.queue.peer_at = (QueuedFlow("m", 1, "a", 1.0, 400, waited=0.1),), h.clock.monotonic()
    h.queue.enqueue(waiting("a", 100))  # the pool's oldest waited 0.1 s: a burst, not overload yet
    h.queue.cancel(h.queue._head())
    h.clock.advance(0.2)  # the peer's head has waited 0.3 s now, past half of max_wait
    assert h.queue.pool_oldest_wait() == pytest.approx(0.3)
    with pytest.raises(RateLimited, match="would not drain"):
        h.queue.enqueue(waiting("a", 100))
