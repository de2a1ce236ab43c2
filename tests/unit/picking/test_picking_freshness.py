from __future__ import annotations

from collections import Counter

import pytest
from picking_helpers import MakePicker, Pool, endpoints, observe

from modeldock.clock import FakeClock
from modeldock.picking import Sample
from modeldock.picking.signals import correct


def test_sample_goes_stale_after_the_limit(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(stale_after=2.0)
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    observe(picker, clock, a, waiting=3, running=4, kv=0.5)
    clock.advance(2.0)
    assert picker.signals(a).fresh
    clock.advance(0.01)
    stale = picker.signals(a)
    assert not stale.fresh
    assert (stale.waiting, stale.running, stale.kv) == (0.0, 0.0, 0.0)
    assert stale.sample == Sample(3, 4, 0.5)  # kept, just not trusted


def test_stale_idle_is_not_mistaken_for_idle(pool: Pool, clock: FakeClock) -> None:
    picker, (stale_idle, fresh_idle) = pool(2)
    observe(picker, clock, stale_idle)  # says idle ...
    clock.advance(5)  # ... but long ago
    observe(picker, clock, fresh_idle)
    assert picker.score(stale_idle) == pytest.approx(0.5)  # the penalty alone
    assert picker.score(fresh_idle) == 0.0
    assert picker.pick("m").primary == fresh_idle


def test_stale_endpoints_share_picks_instead_of_chasing(pool: Pool, clock: FakeClock) -> None:
    picker, eps = pool(3)
    observe(picker, clock, eps[0], waiting=0, running=0, kv=0.0)  # "idle" when last seen
    observe(picker, clock, eps[1], waiting=40, running=100, kv=0.9)
    observe(picker, clock, eps[2], waiting=40, running=100, kv=0.9)
    clock.advance(10)  # the scraper has been failing
    chosen = Counter(picker.pick("m").primary for _ in range(30))  # none released: a burst
    assert chosen == {eps[0]: 10, eps[1]: 10, eps[2]: 10}


def test_seed_policy_chases_the_stale_idle_endpoint(pool: Pool, clock: FakeClock) -> None:
    # The failure mode the default policy avoids, kept visible for comparison.
    picker, eps = pool(2, policy="seed")
    observe(picker, clock, eps[0])
    observe(picker, clock, eps[1], waiting=10, running=50, kv=0.9)
    clock.advance(10)
    chosen = Counter(picker.pick("m").primary for _ in range(30))
    assert chosen[eps[0]] == 30


def test_fresh_busy_vs_stale_split_a_burst(pool: Pool, clock: FakeClock) -> None:
    picker, (fresh, stale) = pool(2)
    observe(picker, clock, stale)
    clock.advance(3)
    observe(picker, clock, fresh, waiting=1, running=10, kv=0.3)
    chosen = Counter(picker.pick("m").primary for _ in range(40))
    assert chosen[fresh] > 0 and chosen[stale] > 0  # neither hogs the burst
    assert chosen[fresh] > chosen[stale]  # the known-good endpoint takes more


def test_local_correction_between_scrapes(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker()
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    observe(picker, clock, a, waiting=1, running=5, kv=0.4)
    leases = [picker.pick("m").lease for _ in range(3)]
    s = picker.signals(a)
    assert (s.waiting, s.running, s.kv, s.in_flight) == (4.0, 5.0, 0.4, 3)  # new picks count as queued
    leases[0].release()
    assert picker.signals(a).waiting == 3.0
    # A new sample already includes those requests: the correction restarts from it.
    clock.advance(0.5)
    observe(picker, clock, a, waiting=0, running=7, kv=0.5)
    assert (picker.signals(a).waiting, picker.signals(a).running) == (0.0, 7.0)
    for lease in leases[1:]:
        lease.release()  # two completions since the sample: they leave the running batch
    assert (picker.signals(a).waiting, picker.signals(a).running) == (0.0, 5.0)


def test_picks_after_the_page_arrived_still_count(make_picker: MakePicker, clock: FakeClock) -> None:
    # The scraper applies a round only when every fetch is done; picks made in
    # between are not in the page, so the baseline is the count at arrival.
    picker = make_picker()
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    arrived_at, in_flight_then = clock.monotonic(), picker.in_flight(a)
    picker.pick("m")
    picker.pick("m")
    picker.observe(a, Sample(waiting=1, running=4, kv=0.2), arrived_at, in_flight_at=in_flight_then)
    assert (picker.signals(a).waiting, picker.signals(a).running) == (3.0, 4.0)


def test_correction_drains_running_then_queue() -> None:
    sample = Sample(waiting=3, running=2, kv=0.1)
    assert correct(sample, 0) == (3, 2)
    assert correct(sample, 4) == (7, 2)
    assert correct(sample, -1) == (3, 1)
    assert correct(sample, -4) == (1, 0)
    assert correct(sample, -10) == (0, 0)


def test_correction_stops_a_burst_from_piling_on(pool: Pool, clock: FakeClock) -> None:
    picker, (a, b) = pool(2, (0, 10, 0.3), (2, 10, 0.3))
    chosen = [picker.pick("m").primary for _ in range(8)]  # no scrape in between
    assert chosen[0] == a
    assert chosen.count(b) >= 3  # once a's estimated queue passes b's, b takes turns


def test_older_results_do_not_replace_newer(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker()
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    picker.observe(a, Sample(1, 1, 0.1), taken_at=clock.monotonic())
    picker.observe(a, Sample(9, 9, 0.9), taken_at=clock.monotonic() - 1)
    assert picker.signals(a).sample == Sample(1, 1, 0.1)


def test_failures_leave_the_sample_to_age(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker()
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    observe(picker, clock, a, waiting=2)
    picker.observe_failure(a)
    picker.observe_failure(a)
    assert picker.signals(a).fresh and picker.signals(a).waiting == 2
    clock.advance(3)
    assert not picker.signals(a).fresh


def test_samples_for_endpoints_outside_the_snapshot_are_dropped(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker()
    a, gone = endpoints(2)
    picker.set_endpoints("m", [a])
    observe(picker, clock, gone, waiting=1)
    picker.observe_failure(gone)
    assert picker.signals(gone).sample is None
    assert picker.scrape_targets() == {a: "m"}
