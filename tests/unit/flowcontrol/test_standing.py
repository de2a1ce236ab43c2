"""A request's standing: a class above it seen lately, or its tenant over its weighted share."""

from __future__ import annotations

from modeldock.clock import FakeClock
from modeldock.flowcontrol.standing import Standing


def test_a_higher_class_seen_within_the_window_makes_lower_classes_leave_headroom() -> None:
    clock = FakeClock()
    standing = Standing(clock, window=2.0)
    assert not standing.must_leave_headroom("m", "bat", 1.0, 0, 0, 0)  # nothing seen on the model
    standing.seen("m", "ivy", 1.0, 2)
    assert standing.must_leave_headroom("m", "bat", 1.0, 0, 0, 0)
    assert not standing.must_leave_headroom("m", "ivy", 1.0, 2, 0, 0)  # the top class is protected
    assert not standing.must_leave_headroom("other", "bat", 1.0, 0, 0, 0)  # per model
    clock.advance(2.0)
    assert not standing.must_leave_headroom("m", "bat", 1.0, 0, 0, 0)  # the window passed


def test_a_tenant_over_its_weighted_share_of_the_tokens_in_flight_leaves_headroom() -> None:
    clock = FakeClock()
    standing = Standing(clock, window=2.0)
    standing.seen("m", "alice", 1.0, 1)
    # Alone, a tenant's share is everything: never over it.
    assert not standing.must_leave_headroom("m", "alice", 1.0, 1, 900, 900)
    standing.seen("m", "bob", 1.0, 1)
    assert standing.active_weight("m") == 2.0
    assert standing.must_leave_headroom("m", "alice", 1.0, 1, 600, 900)  # 2/3 > 1/2
    assert not standing.must_leave_headroom("m", "alice", 1.0, 1, 450, 900)  # exactly her share
    assert not standing.must_leave_headroom("m", "bob", 1.0, 1, 300, 900)
    assert not standing.must_leave_headroom("m", "bob", 1.0, 1, 0, 900)  # nothing in flight: protected
    # Weights: with 3 to bob's 1, alice's share is 3/4.
    standing.seen("m", "alice", 3.0, 1)
    assert standing.active_weight("m") == 4.0
    assert not standing.must_leave_headroom("m", "alice", 3.0, 1, 600, 900)
    clock.advance(1.0)
    standing.seen("m", "alice", 3.0, 1)  # alice again; bob's window ends first
    clock.advance(1.5)
    assert standing.active_weight("m") == 3.0
    assert not standing.must_leave_headroom("m", "alice", 3.0, 1, 900, 900)
    clock.advance(1.0)
    assert standing.active_weight("m") == 0.0


def test_refreshed_tenants_do_not_grow_the_expiry_heap_without_bound() -> None:
    clock = FakeClock()
    standing = Standing(clock, window=2.0)
    for _ in range(1000):
        clock.advance(0.001)
        standing.seen("m", "alice", 1.0, 1)
    assert len(standing._models["m"].expiries) <= 4 + 64
    assert standing.active_weight("m") == 1.0
