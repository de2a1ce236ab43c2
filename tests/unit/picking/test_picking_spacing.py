"""`default` between scrapes: near ties go to the least recently picked endpoint,
and picks and completions since a sample are counted apart."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from picking_helpers import MakePicker, Pool, endpoints, observe

from modeldock.clock import FakeClock
from modeldock.picking import Lease, Picker, Sample
from modeldock.picking.signals import correct
from modeldock.types import Endpoint

# -- near ties: least recently picked ----------------------------------------


def test_equal_endpoints_get_picks_in_rotation(pool: Pool, clock: FakeClock) -> None:
    picker, eps = pool(4, *[(0, 3, 0.3)] * 4)
    chosen = []
    for _ in range(12):
        pick = picker.pick("m")
        chosen.append(pick.primary)
        pick.lease.release()  # each finishes before the next arrives: load stays equal
    assert set(chosen[:4]) == set(eps)  # every endpoint once before any twice ...
    assert chosen == chosen[:4] * 3  # ... and then the same rotation, never random
    assert all(a != b for a, b in itertools.pairwise(chosen))


def test_near_equal_scores_rotate_too(pool: Pool, clock: FakeClock) -> None:
    # Samples a little apart (a stale KV reading, one short request more or less):
    # nothing load can tell apart, so the picks are spaced out instead of chasing the lowest.
    picker, eps = pool(3)
    for ep, kv, running in zip(eps, (0.30, 0.33, 0.35), (2, 3, 2), strict=True):
        observe(picker, clock, ep, waiting=0, running=running, kv=kv)
    scores = [picker.score(ep) or 0.0 for ep in eps]
    assert max(scores) - min(scores) < 0.03 and len(set(scores)) == 3
    chosen = []
    for _ in range(9):
        pick = picker.pick("m")
        chosen.append(pick.primary)
        pick.lease.release()
    assert Counter(chosen) == {eps[0]: 3, eps[1]: 3, eps[2]: 3}
    assert chosen[0] == eps[0]  # the first pick still goes to the best score


def test_a_clearly_better_endpoint_still_wins_every_time(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker()
    better, worse = endpoints(2)
    picker.set_endpoints("m", [worse, better])
    observe(picker, clock, better, waiting=0, running=3, kv=0.2)
    observe(picker, clock, worse, waiting=0, running=3, kv=0.5)  # 0.09 apart: a real difference
    for _ in range(10):
        pick = picker.pick("m")
        assert pick.primary == better and pick.fallbacks == (worse,)
        pick.lease.release()


def test_near_tie_never_goes_to_an_endpoint_holding_more(pool: Pool, clock: FakeClock) -> None:
    # The in-flight count is exact and current; the sample terms may be a scrape old.
    # Near the slot limit one request more moves the score by < 0.01, so without this
    # guard a near tie could queue a request behind a backend's last free slot.
    picker, (a, b) = pool(2)
    first = picker.pick("m")
    second = picker.pick("m")
    held, idle = first.primary, second.primary  # held was picked longer ago ...
    second.lease.release()
    observe(picker, clock, held, running=1, kv=0.30)  # ... and still holds its request
    observe(picker, clock, idle, running=0, kv=0.33)
    assert 0 < (picker.score(held) or 0.0) - (picker.score(idle) or 0.0) < 0.06  # a near tie
    assert picker.pick("m").primary == idle


def test_near_tie_zero_rotates_exact_ties_only(make_picker: MakePicker, pool: Pool, clock: FakeClock) -> None:
    picker, (a, b, c) = pool(3, near_tie=0.0)
    observe(picker, clock, a, running=3, kv=0.30)
    observe(picker, clock, b, running=3, kv=0.30)
    observe(picker, clock, c, running=3, kv=0.31)  # not exactly equal: never leads
    chosen = []
    for _ in range(6):
        pick = picker.pick("m")
        chosen.append(pick.primary)
        pick.lease.release()
    assert set(chosen) == {a, b} and all(x != y for x, y in itertools.pairwise(chosen))
    with pytest.raises(ValueError):
        make_picker(near_tie=-0.1)


def test_other_policies_keep_random_ties(pool: Pool) -> None:
    picker, eps = pool(4, policy="least_request", rng=random.Random(5))
    chosen = []
    for _ in range(40):
        pick = picker.pick("m")
        chosen.append(pick.primary)
        pick.lease.release()
    assert any(a == b for a, b in itertools.pairwise(chosen))  # random, not a rotation


# -- a burst between scrapes ---------------------------------------------------


def test_burst_between_scrapes_spreads_over_endpoints(pool: Pool, clock: FakeClock) -> None:
    picker, eps = pool(4)
    for ep, kv in zip(eps, (0.30, 0.34, 0.32, 0.36), strict=True):
        observe(picker, clock, ep, waiting=0, running=2, kv=kv)
    burst = [picker.pick("m").primary for _ in range(8)]  # within one scrape interval, none finished
    assert Counter(burst) == {ep: 2 for ep in eps}
    assert set(burst[:4]) == set(eps)  # one each before anyone gets a second


def test_burst_after_turnover_is_not_stacked(pool: Pool, clock: FakeClock) -> None:
    # a's sample counted 6 of our requests; they all finish before a burst of 8. The old
    # net count (in_flight - at sample = -6 + picks) hid the first 6 burst picks and a took 7
    # of 8; counting picks apart from completions, every burst pick raises a's queue estimate.
    picker, (a, b) = pool(2, near_tie=0.0)
    before = [picker.pick("m").lease for _ in range(12)]
    assert picker.in_flight(a) == picker.in_flight(b) == 6
    observe(picker, clock, a, waiting=0, running=6, kv=0.3)
    observe(picker, clock, b, waiting=0, running=6, kv=0.3)
    for lease in before:
        if lease.endpoint == a:
            lease.release()  # a's requests turn over (b's are still running)
    burst = [picker.pick("m").primary for _ in range(8)]
    assert burst[0] == a  # a is emptier: it still gets the first
    assert burst.count(a) <= 5 and burst.count(b) >= 3  # but not the whole burst


# -- turnover since a sample ---------------------------------------------------


def test_turnover_since_a_sample_is_not_invisible(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(policy="round_robin")  # rotation: a known placement
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    old = [picker.pick("m").lease for _ in range(2)]
    observe(picker, clock, a, waiting=0, running=2, kv=0.3)  # the page counts our 2
    for lease in old:
        lease.release()
    new = [picker.pick("m").lease for _ in range(2)]
    s = picker.signals(a)
    assert s.in_flight == 2  # as many as at the sample ...
    assert (s.waiting, s.running) == (2.0, 0.0)  # ... but 2 new, queued or prefilling, not the sample's 2 running
    new[0].release()  # a request picked since the sample finishes: it leaves the new ones
    assert (picker.signals(a).waiting, picker.signals(a).running) == (1.0, 0.0)


def test_turnover_makes_an_endpoint_rank_behind_an_unchanged_one(pool: Pool, clock: FakeClock) -> None:
    picker, (a, b) = pool(2, near_tie=0.0)
    leases = [picker.pick("m").lease for _ in range(4)]
    for ep in (a, b):
        observe(picker, clock, ep, waiting=0, running=2, kv=0.3)
    for lease in [lease for lease in leases if lease.endpoint == a]:
        lease.release()
    turned = picker.pick("m")  # a has 0 in flight now: it gets this one
    assert turned.primary == a
    assert picker.in_flight(a) == 1 and picker.in_flight(b) == 2
    # The old net count (in_flight - base = -1) read a as one request lighter than its
    # sample; now it holds one fresh request that may be prefilling: it scores worse than b.
    assert (picker.score(a) or 0.0) > (picker.score(b) or 0.0)
    assert picker.pick("m").primary == b


def test_correction_counts_picks_and_completions_apart() -> None:
    sample = Sample(waiting=1, running=3, kv=0.2)
    assert correct(sample, 2, 2) == (3, 1)  # 2 new queued, 2 of the sample's finished
    assert correct(sample, 2, 5) == (2, 0)  # completions beyond the batch come off its queue ...
    assert correct(sample, 2, 9) == (2, 0)  # ... never off the new ones
    assert correct(sample, 0, 0) == (1, 3)


def test_moved_request_counts_as_new_where_it_went(pool: Pool, clock: FakeClock) -> None:
    picker, (a, b) = pool(2, policy="round_robin")
    observe(picker, clock, a, running=1)
    observe(picker, clock, b, running=1)
    lease = picker.pick("m").lease  # to a, after a's sample: a's new one
    assert picker.signals(a).waiting == 1.0
    lease.move_to(b.address)  # Envoy retried it on b
    assert (picker.signals(a).waiting, picker.signals(a).running) == (0.0, 1.0)  # not a completion at a
    assert (picker.signals(b).waiting, picker.signals(b).running) == (1.0, 1.0)
    lease.release()
    assert (picker.signals(b).waiting, picker.signals(b).running) == (0.0, 1.0)


def test_picks_after_page_arrival_stay_new_when_they_finish(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker()
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    early = picker.pick("m").lease
    arrived_at, in_flight_then = clock.monotonic(), picker.in_flight(a)
    late = picker.pick("m").lease  # after the page arrived, before the round was applied
    picker.observe(a, Sample(waiting=0, running=1, kv=0.1), arrived_at, in_flight_at=in_flight_then)
    assert (picker.signals(a).waiting, picker.signals(a).running) == (1.0, 1.0)
    late.release()
    assert (picker.signals(a).waiting, picker.signals(a).running) == (0.0, 1.0)
    early.release()
    assert (picker.signals(a).waiting, picker.signals(a).running) == (0.0, 0.0)


def test_a_pick_the_page_does_not_show_yet_still_holds_its_slot(make_picker: MakePicker, clock: FakeClock) -> None:
    # Two picks, then a page taken before either reached the backend: it shows nothing running.
    # Read as reflected, the slots would look free until the next page.
    picker = make_picker()
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    first, second = picker.pick("m").lease, picker.pick("m").lease
    picker.observe(a, Sample(waiting=0, running=0, kv=0.0), clock.monotonic(), in_flight_at=picker.in_flight(a))
    assert picker.signals(a).running + picker.signals(a).waiting == 2.0
    # The next page shows them running: no longer counted twice.
    picker.observe(a, Sample(waiting=0, running=2, kv=0.2), clock.monotonic(), in_flight_at=picker.in_flight(a))
    assert (picker.signals(a).waiting, picker.signals(a).running) == (0.0, 2.0)
    first.release()
    second.release()
    assert (picker.signals(a).waiting, picker.signals(a).running) == (0.0, 0.0)


def test_a_request_finished_at_the_backend_before_its_release_is_not_freed_twice(
        make_picker: MakePicker, clock: FakeClock) -> None:
    # Three in flight; the page shows two (one finished there, its stream not ended here yet).
    # Its release must not free a second slot.
    picker = make_picker()
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    leases = [picker.pick("m").lease for _ in range(3)]
    picker.observe(a, Sample(waiting=0, running=2, kv=0.3), clock.monotonic(), in_flight_at=3)
    assert picker.signals(a).running + picker.signals(a).waiting == 3.0
    leases[0].release()
    assert picker.signals(a).running + picker.signals(a).waiting == 2.0


_ops = st.lists(
    st.one_of(
        st.just(("pick", 0)),
        st.tuples(st.just("release"), st.integers(0, 100)),
        st.tuples(st.just("move"), st.integers(0, 100)),
        st.tuples(st.just("observe"), st.integers(0, 100)),
        st.tuples(st.just("observe_late"), st.integers(0, 100)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(_ops, st.integers(0, 2**32))
def test_new_and_gone_stay_consistent(ops: list[tuple[str, int]], seed: int) -> None:
    clock = FakeClock()
    rng = random.Random(seed)
    pool = endpoints(3)
    picker = Picker(clock, rng=random.Random(seed))
    picker.set_endpoints("m", pool)
    leases: list[Lease] = []
    at_arrival: dict[Endpoint, int] = {}
    for op, arg in ops:
        ep = pool[arg % len(pool)]
        if op == "pick":
            leases.append(picker.pick("m").lease)
        elif op == "release" and leases:
            leases[arg % len(leases)].release()
        elif op == "move" and leases:
            leases[arg % len(leases)].move_to(rng.choice(pool).address)
        elif op == "observe":
            at_arrival[ep] = picker.in_flight(ep)
            picker.observe(ep, Sample(rng.randint(0, 3), rng.randint(0, 5), 0.1), clock.monotonic())
        elif op == "observe_late" and ep in at_arrival:
            picker.observe(ep, Sample(0, 2, 0.1), clock.monotonic(), in_flight_at=at_arrival[ep])
        clock.advance(0.01)
        for p in pool:
            load = picker.loads().get(p)
            if load is not None:
                assert 0 <= load.new <= load.in_flight
                assert load.gone >= 0
                assert load.new == sum(seq > load.mark for seq in load.leases)
        s = [picker.signals(p) for p in pool]
        assert all(x.waiting >= 0 and x.running >= 0 for x in s)
    for lease in leases:
        lease.release()
    assert picker.total_in_flight() == 0


def _learn_speed(picker: Picker, clock: FakeClock, ep: Endpoint, tokens_per_s: float) -> None:
    """Two busy pages a second apart: the endpoint's speed is learned from its token counter."""
    for total in (0.0, tokens_per_s):
        clock.advance(1.0)
        picker.observe(ep, Sample(0.0, 1.0, 0.3, tokens_total=total), clock.monotonic())


def _three_speeds(make_picker: MakePicker, clock: FakeClock) -> tuple[Picker, list[Endpoint]]:
    picker = make_picker()
    eps = endpoints(3)  # 1.0x, 0.9x, 0.5x
    picker.set_endpoints("m", eps)
    for ep, speed in zip(eps, (1000.0, 900.0, 500.0), strict=True):
        _learn_speed(picker, clock, ep, speed)
    for ep in eps:  # fresh and equal pages (a page without counters keeps the speed)
        observe(picker, clock, ep, waiting=0, running=1, kv=0.3)
    return picker, eps


def _rotation(picker: Picker, n: int, **kwargs: bool) -> Counter[Endpoint]:
    chosen: Counter[Endpoint] = Counter()
    for _ in range(n):
        pick = picker.pick("m", **kwargs)  # type: ignore[arg-type]
        chosen[pick.primary] += 1
        pick.lease.release()  # equal load every time
    return chosen


def test_a_request_preferring_fast_is_not_spaced_into_a_much_slower_endpoint(
        make_picker: MakePicker, clock: FakeClock) -> None:
    picker, (fast, other, slow) = _three_speeds(make_picker, clock)
    # 0.5x is passed over while the others are as loaded; 0.9x is within SLOWER: spaced as before.
    assert _rotation(picker, 6, prefer_fast=True) == {fast: 3, other: 3}
    # Holding fewer requests than the others, the slow one leads: load still balances.
    held = [picker.pick("m", prefer_fast=True).lease for _ in range(2)]
    assert {lease.endpoint for lease in held} == {fast, other}
    assert picker.pick("m", prefer_fast=True).primary == slow


def test_other_requests_are_spaced_over_every_near_tie_whatever_its_speed(
        make_picker: MakePicker, clock: FakeClock) -> None:
    picker, eps = _three_speeds(make_picker, clock)
    assert _rotation(picker, 6) == {ep: 2 for ep in eps}


def test_an_unknown_speed_is_not_passed_over(pool: Pool, clock: FakeClock) -> None:
    picker, (known, unknown) = pool(2)
    _learn_speed(picker, clock, known, 1000.0)
    for ep in (known, unknown):
        observe(picker, clock, ep, waiting=0, running=1, kv=0.3)
    assert _rotation(picker, 4, prefer_fast=True) == {known: 2, unknown: 2}
