from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from picking_helpers import MakePicker, Pool, endpoints

from modeldock.clock import FakeClock
from modeldock.errors import Unavailable
from modeldock.picking import Lease, Picker


def test_no_endpoints_is_unavailable(make_picker: MakePicker) -> None:
    picker = make_picker()
    with pytest.raises(Unavailable) as caught:
        picker.pick("m")
    assert caught.value.code == "no_ready_endpoints" and caught.value.status == 503
    picker.set_endpoints("m", [])
    with pytest.raises(Unavailable):
        picker.pick("m")
    assert picker.endpoints("m") == ()


def test_move_and_release(pool: Pool) -> None:
    picker, (a, b) = pool(2, policy="round_robin")
    lease = picker.pick("m").lease
    assert lease.endpoint == a and picker.in_flight(a) == 1
    lease.move_to(b.address)
    assert (picker.in_flight(a), picker.in_flight(b)) == (0, 1)
    lease.move_to(b.address)  # same endpoint: no change
    lease.move_to("not an address")
    assert (picker.in_flight(a), picker.in_flight(b), lease.endpoint) == (0, 1, b)
    lease.release()
    lease.release()
    lease.move_to(a.address)  # after release: ignored
    assert picker.total_in_flight() == 0 and picker.in_flight(b) == 0


def test_moving_to_an_address_outside_the_model_is_refused(make_picker: MakePicker) -> None:
    picker = make_picker()
    a, b, other = endpoints(3)
    picker.set_endpoints("m", [a, b])
    picker.set_endpoints("n", [other])
    lease = picker.pick("m").lease
    counted = lease.endpoint
    for address in ("[2001:db8::1]:9000", other.address):  # unknown, or another model's endpoint
        assert lease.move_to(address) is False
        assert lease.endpoint == counted and picker.in_flight(counted) == 1 and picker.total_in_flight() == 1
    assert picker.in_flight(other) == 0
    moved_to = b if counted == a else a
    assert lease.move_to(moved_to.address) is True  # the model's own endpoint still moves
    assert picker.in_flight(moved_to) == 1 and picker.in_flight(counted) == 0
    lease.release()
    assert picker.total_in_flight() == 0


def test_removed_endpoint_keeps_its_count_until_released(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker()
    a, b = endpoints(2)
    picker.set_endpoints("m", [a])
    lease = picker.pick("m").lease
    picker.set_endpoints("m", [b])
    assert picker.in_flight(a) == 1 and picker.total_in_flight() == 1
    assert picker.scrape_targets() == {b: "m"}
    lease.release()
    assert picker.in_flight(a) == 0 and picker.total_in_flight() == 0


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("pick"), st.integers(1, 2)),
        st.tuples(st.just("move"), st.integers(0, 100)),
        st.tuples(st.just("release"), st.integers(0, 100)),
        st.tuples(st.just("reshuffle"), st.integers(0, 100)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(_ops, st.sampled_from(["default", "seed", "least_request", "round_robin"]), st.integers(0, 2**32))
def test_counts_return_to_zero(ops: list[tuple[str, int]], policy: str, seed: int) -> None:
    clock = FakeClock()
    rng = random.Random(seed)
    pool = endpoints(6)
    picker = Picker(clock, policy=policy, rng=random.Random(seed), p2c_threshold=3)
    picker.set_endpoints("m1", pool[:4])
    picker.set_endpoints("m2", pool[2:])
    leases: list[Lease] = []
    for op, arg in ops:
        if op == "pick":
            leases.append(picker.pick(f"m{arg}").lease)
        elif op == "move" and leases:
            leases[arg % len(leases)].move_to(rng.choice([*pool, *endpoints(8)[6:]]).address)
        elif op == "release" and leases:
            leases[arg % len(leases)].release()  # sometimes twice: must be idempotent
        elif op == "reshuffle":
            picker.set_endpoints("m1", rng.sample(pool, 3))
        unreleased = sum(not lease.released for lease in leases)
        assert picker.total_in_flight() == unreleased
        assert all(picker.in_flight(ep) >= 0 for ep in endpoints(8))
    for lease in leases:
        lease.release()
    assert picker.total_in_flight() == 0
    assert all(picker.in_flight(ep) == 0 for ep in endpoints(8))
