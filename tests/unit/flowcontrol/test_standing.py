"""A request's standing: a class above it seen lately, or its tenant over its weighted share."""

from __future__ import annotations

import math
import random

from modeldock.clock import FakeClock
from modeldock.flowcontrol.standing import KEPT_SAMPLES, Standing


def test_a_higher_class_seen_within_the_window_makes_lower_classes_leave_headroom() -> None:
    clock = FakeClock()
    standing = Standing(clock, window=2.0)
    assert not standing.must_leave_headroom("m", "bat", 1.0, 0)  # nothing seen on the model
    standing.seen("m", "ivy", 1.0, 2)
    assert standing.must_leave_headroom("m", "bat", 1.0, 0)
    assert not standing.must_leave_headroom("m", "ivy", 1.0, 2)  # the top class is protected
    assert not standing.must_leave_headroom("other", "bat", 1.0, 0)  # per model
    clock.advance(2.0)
    assert not standing.must_leave_headroom("m", "bat", 1.0, 0)  # the window passed


def _served(standing: Standing, tenant: str, tokens: int, weight: float = 1.0) -> None:
    standing.seen("m", tenant, weight, 1)
    standing.served("m", tenant, tokens, weight)


def test_a_tenant_served_over_its_weighted_share_of_the_tokens_leaves_headroom() -> None:
    clock = FakeClock()
    standing = Standing(clock, window=2.0)
    standing.seen("m", "alice", 1.0, 1)
    standing.seen("m", "bob", 1.0, 1)  # both active from the start: each starts at nothing
    _served(standing, "alice", 900)
    assert not standing.must_leave_headroom("m", "bob", 1.0, 1)
    _served(standing, "bob", 300)
    assert standing.active_weight("m") == 2.0
    assert standing.must_leave_headroom("m", "alice", 1.0, 1)  # 900 of 1200 > 1/2
    assert not standing.must_leave_headroom("m", "bob", 1.0, 1)
    assert not standing.must_leave_headroom("m", "carol", 1.0, 1)  # nothing served yet: protected
    _served(standing, "bob", 600)
    assert not standing.must_leave_headroom("m", "alice", 1.0, 1)  # exactly her share
    assert not standing.must_leave_headroom("m", "bob", 1.0, 1)
    _served(standing, "bob", 1)
    assert standing.must_leave_headroom("m", "bob", 1.0, 1)
    # Weights: with 3 to bob's 1, alice's share is 3/4.
    _served(standing, "alice", 0, weight=3.0)
    assert standing.active_weight("m") == 4.0
    _served(standing, "alice", 1800, weight=3.0)  # 2700 of 3601
    assert not standing.must_leave_headroom("m", "alice", 3.0, 1)


def test_served_tokens_decay_so_a_burst_long_ago_does_not_count_as_now() -> None:
    clock = FakeClock()
    standing = Standing(clock, window=2.0)
    standing.seen("m", "bob", 1.0, 1)
    _served(standing, "alice", 1000)
    _served(standing, "bob", 400)
    assert standing.must_leave_headroom("m", "alice", 1.0, 1)
    clock.advance(2.0)
    assert abs(standing.served_tokens("m", "alice") - 1000 * math.exp(-1)) < 1e-6
    # bob now sends more than alice, in a steady stream: the old burst fades and he is the one over.
    for _ in range(20):
        clock.advance(0.1)
        _served(standing, "bob", 100)
        _served(standing, "alice", 20)
    assert standing.must_leave_headroom("m", "bob", 1.0, 1)
    assert not standing.must_leave_headroom("m", "alice", 1.0, 1)


def test_alone_a_tenant_is_never_over_its_share() -> None:
    clock = FakeClock()
    standing = Standing(clock, window=2.0, share_window=10.0)
    for _ in range(30):
        clock.advance(0.1)
        _served(standing, "alice", 900)
        assert not standing.must_leave_headroom("m", "alice", 1.0, 1)


def test_a_tenant_that_becomes_active_starts_at_its_weighted_share() -> None:
    clock = FakeClock()
    standing = Standing(clock, window=2.0, share_window=10.0)
    for _ in range(50):  # alice alone for 5 s: all that was served is hers
        clock.advance(0.1)
        _served(standing, "alice", 300)
    clock.advance(0.1)
    standing.seen("m", "bob", 1.0, 1)  # bob arrives: both stand at half of the recent total
    assert standing.served_tokens("m", "bob") == standing.served_tokens("m", "alice")
    assert not standing.must_leave_headroom("m", "alice", 1.0, 1)
    assert not standing.must_leave_headroom("m", "bob", 1.0, 1)
    # A newcomer that floods is over its share from its first request: not protected while its
    # tokens are not in the average yet; the one that was alone is not over it for having been.
    _served(standing, "bob", 300)
    assert standing.must_leave_headroom("m", "bob", 1.0, 1)
    assert not standing.must_leave_headroom("m", "alice", 1.0, 1)
    # A third, of weight 2: a half of the total, the others keeping their standing between them.
    before = standing.served_tokens("m", "bob") / standing.served_tokens("m", "alice")
    standing.seen("m", "carol", 2.0, 1)
    carol = standing.served_tokens("m", "carol")
    assert abs(carol - standing.served_tokens("m", "alice") - standing.served_tokens("m", "bob")) < 1e-6
    assert standing.served_tokens("m", "bob") / standing.served_tokens("m", "alice") == before
    assert standing.must_leave_headroom("m", "bob", 1.0, 1)
    assert not standing.must_leave_headroom("m", "carol", 2.0, 1)


def test_the_first_tenant_after_a_quiet_spell_starts_the_history_afresh() -> None:
    clock = FakeClock()
    standing = Standing(clock, window=2.0, share_window=10.0)
    _served(standing, "alice", 5000)
    clock.advance(2.5)  # alice's window passed: nobody is active
    _served(standing, "bob", 100)
    assert standing.served_tokens("m", "alice") == 0.0
    standing.seen("m", "alice", 1.0, 1)  # back: she starts at her share of bob's 100, not her 5000
    assert abs(standing.served_tokens("m", "alice") - 100) < 1e-6
    assert not standing.must_leave_headroom("m", "alice", 1.0, 1)
    assert not standing.must_leave_headroom("m", "bob", 1.0, 1)


def test_a_tenant_that_leaves_takes_its_part_of_the_total_with_it() -> None:
    clock = FakeClock()
    standing = Standing(clock, window=2.0, share_window=10.0)
    for tenant in ("alice", "bob", "carol"):
        standing.seen("m", tenant, 1.0, 1)
    _served(standing, "carol", 6000)
    _served(standing, "alice", 1500)
    _served(standing, "bob", 1000)
    # alice holds 1500 of 8500, under a third; once carol leaves she holds 1500 of 2500: over half.
    assert not standing.must_leave_headroom("m", "alice", 1.0, 1)
    clock.advance(1.5)
    standing.seen("m", "alice", 1.0, 1)
    standing.seen("m", "bob", 1.0, 1)
    clock.advance(1.0)  # carol's window passed
    assert standing.active_weight("m") == 2.0
    assert standing.must_leave_headroom("m", "alice", 1.0, 1)
    assert not standing.must_leave_headroom("m", "bob", 1.0, 1)


def test_a_quiet_tenant_that_comes_back_now_and_then_stays_protected() -> None:
    # bob sends four requests at once every 5 s (his window of 2 s passes in between) while alice
    # floods: back, he starts at what he was served before he left when that is less than his
    # share, so only his very first burst finds him at his share (a newcomer could be a flood).
    clock = FakeClock()
    standing = Standing(clock, window=2.0, share_window=10.0)
    over: list[int] = []
    for step in range(300):  # 30 s
        clock.advance(0.1)
        _served(standing, "alice", 300)
        if step % 50 == 0:
            over.append(0)
            for _ in range(4):
                standing.seen("m", "bob", 1.0, 1)
                over[-1] += standing.must_leave_headroom("m", "bob", 1.0, 1)
                standing.served("m", "bob", 300, 1.0)
    assert over[0] == 3 and over[1:] == [0] * 5


def test_a_request_dispatched_after_its_tenant_went_quiet_joins_again() -> None:
    # bob's request waited in the queue longer than the window: dispatched, he is active again,
    # inside the total, at what he had when he left (less than his share) plus this request.
    clock = FakeClock()
    standing = Standing(clock, window=2.0, share_window=10.0)
    standing.seen("m", "bob", 1.0, 1)
    for _ in range(30):
        clock.advance(0.1)
        _served(standing, "alice", 300)
    assert standing.active_weight("m") == 1.0  # bob's window passed
    standing.served("m", "bob", 300, 1.0)
    assert standing.active_weight("m") == 2.0
    m = standing._models["m"]
    now = clock.monotonic()
    parts = sum(standing._decayed(entry, now) for entry in m.served.values())
    assert abs(standing._decayed(m.served_total, now) - parts) < 1e-6  # no tokens belong to no one
    assert abs(standing.served_tokens("m", "bob") - 300) < 1e-6  # he had nothing before: 0 + 300
    assert not standing.must_leave_headroom("m", "bob", 1.0, 1)


def test_the_total_is_the_sum_of_the_active_tenants_parts() -> None:
    rng = random.Random(7)
    clock = FakeClock()
    standing = Standing(clock, window=2.0, share_window=10.0)
    tenants = {"alice": 1.0, "bob": 2.0, "carol": 0.5}
    for _ in range(3000):
        clock.advance(rng.choice((0.01, 0.1, 0.5, 2.5)))
        tenant = rng.choice(list(tenants))
        if rng.random() < 0.5:
            standing.seen("m", tenant, tenants[tenant], 1)
        else:
            standing.served("m", tenant, rng.randrange(1, 1000), tenants[tenant])
        standing.active_weight("m")  # expire who is due
        m = standing._models["m"]
        now = clock.monotonic()
        assert set(m.served) <= set(m.tenants)
        parts = sum(standing._decayed(entry, now) for entry in m.served.values())
        total = standing._decayed(m.served_total, now)
        assert abs(total - parts) <= 1e-6 * max(1.0, total)
        alone = len(m.tenants) == 1 and next(iter(m.tenants))
        if alone:
            assert not standing.must_leave_headroom("m", alone, tenants[alone], 1)


def _clump(share_window: float) -> bool:
    """A tenant at half the other's rate, then a clump: 8 of its requests in a second while the
    other gets nothing. Is it over its share at the clump's end?"""
    clock = FakeClock()
    standing = Standing(clock, window=2.0, share_window=share_window)
    standing.seen("m", "alice", 1.0, 1)
    standing.seen("m", "bob", 1.0, 1)
    for step in range(400):  # 40 s: alice 3000 tokens/s, bob 1500
        clock.advance(0.1)
        _served(standing, "alice", 300)
        if step % 2:
            _served(standing, "bob", 300)
    for _ in range(8):
        clock.advance(0.125)
        _served(standing, "bob", 365)
        standing.seen("m", "alice", 1.0, 1)  # still there, queued
    return standing.must_leave_headroom("m", "bob", 1.0, 1)


def test_a_clump_within_a_tenants_share_is_not_over_it_with_the_longer_average() -> None:
    assert not _clump(share_window=10.0)
    assert _clump(share_window=2.0)  # why the average is longer than the activity window


def test_active_tenants_expire_with_the_window() -> None:
    clock = FakeClock()
    standing = Standing(clock, window=2.0)
    standing.seen("m", "alice", 3.0, 1)
    standing.seen("m", "bob", 1.0, 1)
    clock.advance(1.0)
    standing.seen("m", "alice", 3.0, 1)  # alice again; bob's window ends first
    clock.advance(1.5)
    assert standing.active_weight("m") == 3.0
    clock.advance(1.0)
    assert standing.active_weight("m") == 0.0


def test_kept_tokens_fit_every_recent_protected_request() -> None:
    clock = FakeClock()
    standing = Standing(clock, window=2.0)
    assert standing.kept_tokens("m") is None  # nothing seen: the picker's own default applies
    standing.protected("m", 5000)  # an outlier long ago: only the last KEPT_SAMPLES count
    for cost in range(100, 0, -1):  # the last KEPT_SAMPLES: 32..1
        standing.protected("m", cost)
    assert len(standing._models["m"].costs) == KEPT_SAMPLES
    assert standing.kept_tokens("m") == KEPT_SAMPLES  # the largest of them: every one fits
    standing.protected("m", 700)  # a new sample is taken into account at the next question
    assert standing.kept_tokens("m") == 700
    assert standing.kept_tokens("other") is None


def test_refreshed_tenants_do_not_grow_the_expiry_heap_without_bound() -> None:
    clock = FakeClock()
    standing = Standing(clock, window=2.0)
    for _ in range(1000):
        clock.advance(0.001)
        standing.seen("m", "alice", 1.0, 1)
    assert len(standing._models["m"].expiries) <= 4 + 64
    assert standing.active_weight("m") == 1.0
