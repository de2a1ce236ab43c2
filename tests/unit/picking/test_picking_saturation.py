from __future__ import annotations

import pytest
from picking_helpers import MakePicker, Pool, endpoints, observe

from modeldock.clock import FakeClock
from modeldock.errors import RateLimited, Unavailable
from modeldock.picking import Saturation


def test_rejects_with_429_when_every_candidate_is_over(pool: Pool, clock: FakeClock) -> None:
    picker, (a, b) = pool(2, saturation=Saturation(max_waiting=10, max_kv=0.95))
    observe(picker, clock, a, waiting=12, kv=0.5)
    observe(picker, clock, b, waiting=0, kv=0.97)
    with pytest.raises(RateLimited) as caught:
        picker.pick("m")
    rejection = caught.value
    assert rejection.status == 429
    assert rejection.headers == {"Retry-After": "1"}
    assert rejection.code == "endpoints_saturated"
    assert "'m'" in rejection.message and "queue >= 10" in rejection.message and "95%" in rejection.message
    assert picker.total_in_flight() == 0  # nothing was counted


def test_can_reject_with_503(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(saturation=Saturation(max_waiting=1, reject="unavailable"))
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    observe(picker, clock, a, waiting=1)
    with pytest.raises(Unavailable) as caught:
        picker.pick("m")
    assert caught.value.status == 503 and caught.value.code == "endpoints_saturated"


def test_picks_an_unsaturated_endpoint_when_one_exists(pool: Pool, clock: FakeClock) -> None:
    picker, (full, ok) = pool(2, saturation=Saturation(max_kv=0.9), fallbacks=1)
    observe(picker, clock, full, kv=0.95)
    observe(picker, clock, ok, waiting=30, running=200, kv=0.85)  # busier by every other measure
    pick = picker.pick("m")
    assert pick.primary == ok and pick.fallbacks == (full,)


def test_picks_push_an_endpoint_over_the_queue_limit(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(saturation=Saturation(max_waiting=3))
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    observe(picker, clock, a, waiting=1)
    picker.pick("m")
    picker.pick("m")  # estimated queue is now 3
    with pytest.raises(RateLimited):
        picker.pick("m")


def test_stale_endpoints_are_never_saturated(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(saturation=Saturation(max_waiting=5))
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    observe(picker, clock, a, waiting=50)
    clock.advance(5)
    assert picker.pick("m").primary == a


def test_off_by_default(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker()
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    observe(picker, clock, a, waiting=10_000, kv=1.0)
    assert picker.pick("m").primary == a


def test_two_choices_finds_the_last_free_endpoint(pool: Pool, clock: FakeClock) -> None:
    picker, eps = pool(50, saturation=Saturation(max_waiting=5))
    for ep in eps[1:]:
        observe(picker, clock, ep, waiting=9)
    observe(picker, clock, eps[0], waiting=0)
    for _ in range(5):
        assert picker.pick("m").primary == eps[0]
    for ep in eps:
        observe(picker, clock, ep, waiting=9)
    with pytest.raises(RateLimited):
        picker.pick("m")


def test_round_robin_skips_saturated(pool: Pool, clock: FakeClock) -> None:
    picker, (a, b, c) = pool(3, policy="round_robin", saturation=Saturation(max_kv=0.9))
    observe(picker, clock, b, kv=0.99)
    assert [picker.pick("m").primary for _ in range(4)] == [a, c, c, a]


def test_validation() -> None:
    with pytest.raises(ValueError):
        Saturation(max_kv=80)  # a percentage where a fraction belongs
    with pytest.raises(ValueError):
        Saturation(max_waiting=1, reject="teapot")  # type: ignore[arg-type]
