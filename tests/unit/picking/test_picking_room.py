"""Room: the backend's own queue and its learned batch limit make an endpoint full."""

from __future__ import annotations

import pytest
from picking_helpers import MakePicker, Pool, endpoints

from modeldock.clock import FakeClock
from modeldock.picking import Picker, Sample, Saturated, Saturation


def _see(picker: Picker, clock: FakeClock, ep: object, waiting: float, running: float, total: float = 0.0) -> None:
    picker.observe(ep, Sample(waiting=waiting, running=running, kv=0.1, tokens_total=total),  # type: ignore[arg-type]
                   clock.monotonic())


def test_a_backend_queue_means_no_room_whatever_the_kv(pool: Pool, clock: FakeClock) -> None:
    picker, (a, b) = pool(2, saturation=Saturation(room=True))
    _see(picker, clock, a, waiting=1, running=3)  # KV 10%: only the queue says it is full
    _see(picker, clock, b, waiting=0, running=1)
    assert picker.pick("m").primary == b
    _see(picker, clock, b, waiting=2, running=4)
    with pytest.raises(Saturated):
        picker.pick("m")
    assert picker.total_in_flight() == 1  # the refused pick counted nothing


def test_completions_since_the_sample_drain_the_backend_queue(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(saturation=Saturation(room=True))
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    leases = [picker.pick("m").lease for _ in range(2)]
    _see(picker, clock, a, waiting=1, running=1)  # both of ours in it
    with pytest.raises(Saturated):
        picker.pick("m")
    leases[0].release()  # one finished: the waiting one runs now, nothing waits
    assert picker.pick("m").primary == a


def test_the_batch_limit_is_learned_from_a_lasting_queue(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(saturation=Saturation(room=True))
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    _see(picker, clock, a, waiting=3, running=1)  # a queue caught between arrival and the next step
    _see(picker, clock, a, waiting=0, running=1)
    assert picker.load(a).limit == 0  # one page with a queue teaches nothing
    _see(picker, clock, a, waiting=2, running=4)
    _see(picker, clock, a, waiting=1, running=4)
    assert picker.load(a).limit == 4
    _see(picker, clock, a, waiting=0, running=2)  # room for two more, and no more between samples
    picker.pick("m")
    picker.pick("m")
    with pytest.raises(Saturated):
        picker.pick("m")


def test_a_stale_sample_falls_back_to_in_flight_against_the_limit(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(saturation=Saturation(room=True), stale_after=2.0)
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    _see(picker, clock, a, waiting=1, running=2)
    _see(picker, clock, a, waiting=1, running=2)
    clock.advance(5.0)  # stale now
    picker.pick("m")
    picker.pick("m")
    with pytest.raises(Saturated):
        picker.pick("m")


def test_drain_rate_is_learned_only_while_full(pool: Pool, clock: FakeClock) -> None:
    picker, (a, b) = pool(2, saturation=Saturation(room=True))
    _see(picker, clock, a, waiting=0, running=1, total=0)
    clock.advance(1.0)
    _see(picker, clock, a, waiting=0, running=1, total=100)  # busy, not full: 100 tokens/s
    assert picker.load(a).drain == 0 and picker.speed("m") == pytest.approx(100)
    _see(picker, clock, a, waiting=2, running=4, total=100)
    clock.advance(1.0)
    _see(picker, clock, a, waiting=2, running=4, total=1100)  # full all along: 1000 tokens/s
    assert picker.load(a).drain == pytest.approx(1000)
    assert picker.speed("m") == pytest.approx(1000)  # b has learned nothing: adds nothing


def test_a_backend_at_its_declared_batch_limit_is_full_for_the_drain_rate(
        make_picker: MakePicker, clock: FakeClock) -> None:
    # The gateway keeps a backend from queueing once its limit is known: running at the limit
    # at both pages is as full as it gets, and is how fast a queue in the gateway drains.
    picker = make_picker(saturation=Saturation(room=True))
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a], max_num_seqs=4)
    _see(picker, clock, a, waiting=0, running=4, total=0)
    clock.advance(1.0)
    _see(picker, clock, a, waiting=0, running=3, total=300)  # not at the limit at this page
    assert picker.load(a).drain == 0
    clock.advance(1.0)
    _see(picker, clock, a, waiting=0, running=4, total=1300)
    clock.advance(1.0)
    _see(picker, clock, a, waiting=0, running=4, total=2500)  # at the limit at both: 1200 tokens/s
    assert picker.load(a).drain == pytest.approx(1200)
    # The load drops: its speed reads low, the rate a queue drains at stays.
    for total in (2700, 2800, 2900):
        clock.advance(1.0)
        _see(picker, clock, a, waiting=0, running=1, total=total)
    assert picker.load(a).speed < 500
    assert picker.speed("m") == pytest.approx(1200)


def test_a_restart_forgets_the_limit(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(saturation=Saturation(room=True))
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    _see(picker, clock, a, waiting=1, running=4, total=500)
    _see(picker, clock, a, waiting=1, running=4, total=600)
    assert picker.load(a).limit == 4
    _see(picker, clock, a, waiting=0, running=0, total=10)  # the counter went back: restarted
    assert picker.load(a).limit == 0


def test_a_queue_waiting_for_memory_teaches_no_batch_limit(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(saturation=Saturation(room=True))
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    for kv in (0.95, 0.97):  # two long generations fill the cache; the next request waits for memory
        picker.observe(a, Sample(waiting=1, running=2, kv=kv, capacity=1000.0), clock.monotonic())
    assert picker.load(a).limit == 0  # a slot limit of 2 would hold short requests later for good
    picker.observe(a, Sample(waiting=1, running=3, kv=0.4, capacity=1000.0), clock.monotonic())
    picker.observe(a, Sample(waiting=2, running=3, kv=0.5, capacity=1000.0), clock.monotonic())
    assert picker.load(a).limit == 3  # waiting with room in the cache: the slots are full


def test_running_above_the_learned_limit_raises_it(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(saturation=Saturation(room=True))
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    _see(picker, clock, a, waiting=1, running=2)
    _see(picker, clock, a, waiting=1, running=2)
    assert picker.load(a).limit == 2
    _see(picker, clock, a, waiting=0, running=3)  # another gateway's requests: three fit after all
    assert picker.load(a).limit == 3


def test_a_declared_batch_limit_holds_from_the_first_pick(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(saturation=Saturation(room=True))
    a, b = endpoints(2)
    picker.set_endpoints("m", [a, b], max_num_seqs=2)  # no page yet, no queue ever seen
    leases = {picker.pick("m").lease for _ in range(4)}  # two per endpoint
    assert {lease.endpoint for lease in leases} == {a, b}
    with pytest.raises(Saturated):
        picker.pick("m")
    leases.pop().release()
    picker.pick("m")  # the freed slot, and only it
    with pytest.raises(Saturated):
        picker.pick("m")
    # From a fresh page too; headroom keeps the declared limit's last slot for protected requests.
    for lease in leases:
        lease.release()
    _see(picker, clock, a, waiting=0, running=1)
    _see(picker, clock, b, waiting=0, running=2)
    with pytest.raises(Saturated):
        picker.pick("m", headroom=1)
    assert picker.pick("m").primary == a


def test_a_restart_returns_to_the_declared_limit(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(saturation=Saturation(room=True))
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a], max_num_seqs=3)
    _see(picker, clock, a, waiting=0, running=5, total=500)  # another gateway's requests: five run
    assert picker.load(a).limit == 5
    _see(picker, clock, a, waiting=0, running=0, total=10)  # restarted
    assert picker.load(a).limit == 3


def test_the_declared_limit_follows_the_config(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(saturation=Saturation(room=True))
    a, b = endpoints(2)
    picker.set_endpoints("m", [a], max_num_seqs=4)
    picker.set_endpoints("n", [a, b], max_num_seqs=6)  # shared by two models: the larger one
    _see(picker, clock, a, waiting=0, running=0)
    _see(picker, clock, b, waiting=0, running=0)
    assert picker.load(a).limit == 6 and picker.load(b).limit == 6
    picker.set_endpoints("n", [b])
    assert picker.load(a).limit == 4
    picker.set_endpoints("m", [a])  # no longer declared: learned again from nothing
    assert picker.load(a).limit == 0
