"""The ledger's lease lifecycle, driven directly (no picker): claim, move, release, drop,
the tokens each carries, and the lookups for models and endpoints it does not know."""

from __future__ import annotations

import pytest
from picking_helpers import endpoints

from modeldock.clock import FakeClock
from modeldock.picking.ledger import Lease, Ledger
from modeldock.picking.signals import Sample


def make_ledger(**kwargs: float) -> tuple[Ledger, FakeClock]:
    clock = FakeClock()
    return Ledger(clock, **kwargs), clock


def test_a_new_lease_is_not_released_and_released_once() -> None:
    ledger, _ = make_ledger()
    (a,) = endpoints(1)
    ledger.set_endpoints("m", [a])
    lease = ledger.claim("m", a)
    assert lease.released is False
    lease.release()
    assert lease.released is True and ledger.in_flight(a) == 0
    lease.release()
    assert ledger.in_flight(a) == 0 and ledger.total_in_flight() == 0


def test_move_to_reports_false_when_nothing_moved() -> None:
    ledger, _ = make_ledger()
    a, b = endpoints(2)
    ledger.set_endpoints("m", [a, b])
    lease = ledger.claim("m", a, tokens=50)
    assert lease.move_to("not an address") is False
    assert lease.move_to(a.address) is False  # the one counted already
    assert (lease.endpoint, ledger.in_flight(a), ledger.committed(a)) == (a, 1, 50)
    lease.release()
    assert lease.move_to(b.address) is False  # released: a move must not count it again
    assert lease.endpoint == a and ledger.total_in_flight() == 0
    assert ledger.committed(a) == 0 and ledger.committed(b) == 0


def test_default_tokens_commit_nothing() -> None:
    ledger, _ = make_ledger()
    a, b = endpoints(2)
    ledger.set_endpoints("m", [a, b])
    lease = ledger.claim("m", a)
    assert lease.tokens == 0 and ledger.committed(a) == 0 and ledger.in_flight(a) == 1
    seq = ledger.claim("m", a, tokens=7)._seq
    moved = ledger.move(a, seq, b)  # a move given no tokens commits none at the target
    assert moved > seq and ledger.committed(b) == 0 and ledger.in_flight(b) == 1
    assert ledger.committed(a) == 0 and ledger.in_flight(a) == 1
    # A lease built by hand commits nothing either, and moves nothing along.
    by_hand = Lease(ledger, "m", b, moved)
    assert by_hand.tokens == 0 and by_hand.released is False
    assert by_hand.move_to(a.address) is True
    assert ledger.committed(a) == 0 and ledger.in_flight(a) == 2 and ledger.in_flight(b) == 0


def test_tokens_follow_the_lease_and_come_back_once() -> None:
    ledger, _ = make_ledger()
    a, b = endpoints(2)
    ledger.set_endpoints("m", [a, b])
    lease = ledger.claim("m", a, tokens=300)
    other = ledger.claim("m", a, tokens=20)
    assert ledger.committed(a) == 320
    assert lease.move_to(b.address) is True
    assert (ledger.committed(a), ledger.committed(b), lease.tokens) == (20, 300, 300)
    lease.release()
    lease.release()
    assert (ledger.committed(a), ledger.committed(b)) == (20, 0)
    other.release()
    assert ledger.committed(a) == 0 and ledger.total_in_flight() == 0


def test_unknown_model_has_no_endpoints_and_serves_nothing() -> None:
    ledger, _ = make_ledger()
    a, b = endpoints(2)
    assert ledger.endpoints("ghost") == ()
    assert ledger.serves("ghost", a) is False
    ledger.set_endpoints("m", [a])
    assert ledger.endpoints("ghost") == () and ledger.serves("ghost", a) is False
    assert ledger.serves("m", a) is True and ledger.serves("m", b) is False
    # A lease of a model the ledger does not list cannot move anywhere.
    lease = ledger.claim("ghost", a)
    assert lease.move_to(b.address) is False and lease.endpoint == a
    lease.release()
    assert ledger.total_in_flight() == 0


def test_load_of_an_unknown_endpoint_is_an_empty_read_only_state() -> None:
    ledger, _ = make_ledger()
    (a,) = endpoints(1)
    load = ledger.load(a)
    assert load.in_flight == 0 and load.committed == 0 and load.sample is None and load.failures == 0
    assert a not in ledger.loads  # reading does not create state


def test_observe_failure_counts_consecutive_failures_of_current_endpoints_only() -> None:
    ledger, clock = make_ledger()
    a, gone = endpoints(2)
    ledger.set_endpoints("m", [a])
    ledger.observe_failure(a)  # never sampled nor counted: a load is made for it
    assert ledger.load(a).failures == 1
    ledger.observe_failure(a)
    ledger.observe_failure(a)
    assert ledger.load(a).failures == 3
    ledger.observe(a, Sample(waiting=0, running=0, kv=0), clock.monotonic())
    assert ledger.load(a).failures == 0  # a good sample ends the run
    ledger.observe_failure(gone)  # not in the snapshot: nothing is kept for it
    assert gone not in ledger.loads and ledger.load(gone).failures == 0


def test_a_removed_endpoint_keeps_its_count_until_its_last_lease_goes() -> None:
    ledger, _ = make_ledger()
    a, b = endpoints(2)
    ledger.set_endpoints("m", [a, b])
    first, second = ledger.claim("m", a, tokens=10), ledger.claim("m", a, tokens=5)
    assert ledger.set_endpoints("m", [b]) == frozenset({a})
    assert ledger.in_flight(a) == 2  # still counted while its requests finish
    first.release()
    assert a in ledger.loads and ledger.in_flight(a) == 1 and ledger.committed(a) == 5
    second.release()
    assert a not in ledger.loads  # nothing left to count: its state is freed
    assert ledger.total_in_flight() == 0
    # An endpoint still listed keeps its state (its sample) after its last lease.
    lease = ledger.claim("m", b)
    lease.release()
    assert b in ledger.loads


def test_moving_away_from_a_removed_endpoint_frees_it() -> None:
    ledger, _ = make_ledger()
    a, b = endpoints(2)
    ledger.set_endpoints("m", [a, b])
    lease = ledger.claim("m", a, tokens=40)
    ledger.set_endpoints("m", [b])
    assert lease.move_to(b.address) is True
    assert a not in ledger.loads and ledger.committed(b) == 40 and ledger.in_flight(b) == 1


def test_stale_after_defaults_to_two_seconds() -> None:
    ledger, clock = make_ledger()
    (a,) = endpoints(1)
    ledger.set_endpoints("m", [a])
    ledger.observe(a, Sample(waiting=3, running=1, kv=0.5), clock.monotonic())
    clock.advance(2.0)
    assert ledger.signals(a).fresh is True
    clock.advance(0.5)
    assert ledger.signals(a).fresh is False


def test_signals_use_the_time_given() -> None:
    ledger, clock = make_ledger(stale_after=1.0)
    (a,) = endpoints(1)
    ledger.set_endpoints("m", [a])
    taken = clock.monotonic()
    ledger.observe(a, Sample(waiting=3, running=1, kv=0.5), taken)
    assert ledger.signals(a).fresh is True  # now: the clock's
    assert ledger.signals(a, now=taken + 5.0).fresh is False
    clock.advance(5.0)
    assert ledger.signals(a).fresh is False
    assert ledger.signals(a, now=taken + 0.5).fresh is True


@pytest.mark.parametrize("stale_after", [0.0, -1.0])
def test_stale_after_must_be_positive(stale_after: float) -> None:
    with pytest.raises(ValueError, match=r"^stale_after must be > 0$"):
        Ledger(FakeClock(), stale_after)
