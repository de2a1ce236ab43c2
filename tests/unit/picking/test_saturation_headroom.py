"""The room rule with headroom: a request that must leave it sees an endpoint as full earlier."""

from __future__ import annotations

import pytest

from modeldock.clock import FakeClock
from modeldock.picking import Picker, Sample, Saturated, Saturation
from modeldock.picking.saturation import UNKNOWN_LIMIT
from modeldock.picking.signals import Signals
from modeldock.types import Endpoint

ROOM = Saturation(room=True)


def _signals(running: float, *, fresh: bool = True, limit: float = 4.0, capacity: float = 0.0,
             committed: int = 0, in_flight: int = 0) -> Signals:
    return Signals(fresh=fresh, sample=None, running=running if fresh else 0.0,
                   in_flight=in_flight, committed=committed, capacity=capacity, limit=limit)


def test_headroom_makes_the_last_slot_full_for_those_who_must_leave_it() -> None:
    s = _signals(running=3)
    assert not ROOM.over(s)  # a protected request may use the last slot
    assert ROOM.over(s, headroom=1)
    assert not ROOM.over(_signals(running=2), headroom=1)
    assert ROOM.over(_signals(running=2), headroom=2)


def test_stale_sample_counts_in_flight_against_the_limit_less_headroom() -> None:
    s = _signals(running=0, fresh=False, in_flight=3)
    assert not ROOM.over(s) and ROOM.over(s, headroom=1)


def test_headroom_never_closes_an_endpoint_entirely() -> None:
    # A batch limit of 1 keeps its one slot usable: headroom leaves at least one.
    assert not ROOM.over(_signals(running=0, limit=1.0), headroom=1)
    assert ROOM.over(_signals(running=1, limit=1.0), headroom=1)


def test_token_headroom_is_the_capacitys_share_of_the_slots_by_default() -> None:
    # Capacity 1000 over 4 slots: one slot of headroom keeps 250 tokens free.
    s = _signals(running=1, capacity=1000.0, committed=600, in_flight=1)
    assert not ROOM.over(s, cost=150) and not ROOM.over(s, cost=150, headroom=1)
    assert ROOM.over(s, cost=200, headroom=1) and not ROOM.over(s, cost=200)
    # An explicit token headroom replaces the derived one.
    assert not ROOM.over(s, cost=200, headroom=1, headroom_tokens=100)
    assert ROOM.over(s, cost=200, headroom=0, headroom_tokens=300)


def test_unknown_limit_and_capacity_leave_the_rule_as_it_was() -> None:
    s = _signals(running=30, limit=0.0)
    assert ROOM.over(s, headroom=1) == ROOM.over(s) is False


def test_picker_refuses_a_request_that_must_leave_headroom_and_serves_a_protected_one() -> None:
    clock = FakeClock()
    ep = Endpoint("10.0.0.1", 8000)
    picker = Picker(clock, fallbacks=0, saturation=ROOM)
    picker.set_endpoints("m", [ep])
    for _ in range(2):  # a queue that lasted two pages at 2 running: batch limit 2
        clock.advance(0.1)
        picker.observe(ep, Sample(1.0, 2.0, 0.1), clock.monotonic())
    clock.advance(0.1)
    picker.observe(ep, Sample(0.0, 0.0, 0.1), clock.monotonic())
    first = picker.pick("m", cost=10, headroom=1)
    with pytest.raises(Saturated):
        picker.pick("m", cost=10, headroom=1)  # refused: counts nothing
    last = picker.pick("m", cost=10)  # protected: takes the last slot
    assert picker.committed(ep) == 20 and picker.total_in_flight() == 2
    first.lease.release()
    last.lease.release()
    assert picker.committed(ep) == picker.total_in_flight() == 0


def test_token_headroom_applies_before_the_batch_limit_is_learned() -> None:
    # A backend kept from queueing never shows its limit: the token rule must still keep room,
    # by default the capacity's share of the kept slots out of UNKNOWN_LIMIT.
    s = _signals(running=2, limit=0.0, capacity=1000.0, committed=600, in_flight=2)
    kept = int(1000 * 1 / UNKNOWN_LIMIT)
    assert not ROOM.over(s, cost=1000 - 600 - kept)
    assert ROOM.over(s, cost=1000 - 600 - kept + 1, headroom=1)
    assert not ROOM.over(s, cost=1000 - 600 - kept, headroom=1)
    # Sized by the caller (the protected requests' costs), whatever the limit.
    assert ROOM.over(s, cost=101, headroom=1, headroom_tokens=300)
    assert not ROOM.over(s, cost=100, headroom=1, headroom_tokens=300)


def test_at_most_half_the_cache_is_kept() -> None:
    s = _signals(running=1, limit=0.0, capacity=1000.0, committed=200, in_flight=1)
    assert not ROOM.over(s, cost=300, headroom=1, headroom_tokens=5000)  # 200 + 300 <= 1000 / 2
    assert ROOM.over(s, cost=301, headroom=1, headroom_tokens=5000)


def test_kv_freed_by_requests_finished_since_the_sample_is_not_counted_as_full() -> None:
    clock = FakeClock()
    ep = Endpoint("10.0.0.1", 8000)
    picker = Picker(clock, fallbacks=0, saturation=ROOM)
    picker.set_endpoints("m", [ep])
    leases = [picker.pick("m", cost=400).lease for _ in range(2)]
    picker.observe(ep, Sample(0.0, 2.0, 0.95, capacity=1000.0), clock.monotonic())  # both in it, KV 95%
    picker.pick("m", cost=50)  # picked since the sample: counts as waiting
    with pytest.raises(Saturated):  # waiting at a KV >= 90%: vLLM queues for memory
        picker.pick("m", cost=50)
    leases[0].release()  # finished since the sample: its 400 tokens are free again
    assert picker.signals(ep).gone_tokens == 400
    assert picker.pick("m", cost=50).primary == ep
    # A new sample starts the count over.
    picker.observe(ep, Sample(0.0, 3.0, 0.5, capacity=1000.0), clock.monotonic())
    assert picker.signals(ep).gone_tokens == 0
