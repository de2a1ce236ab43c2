from __future__ import annotations

from collections import Counter

import pytest
from picking_helpers import MakePicker, Pool, endpoints, observe

from modeldock.clock import FakeClock
from modeldock.picking import Picker
from modeldock.picking.scorers import Scorer
from modeldock.picking.signals import Signals
from modeldock.types import Endpoint


def test_default_prefers_short_queue_at_equal_in_flight(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker()
    short, long = endpoints(2)
    picker.set_endpoints("m", [long, short])
    observe(picker, clock, short, waiting=1, running=30, kv=0.5)
    observe(picker, clock, long, waiting=12, running=30, kv=0.5)
    assert picker.in_flight(short) == picker.in_flight(long) == 0
    for _ in range(20):
        pick = picker.pick("m")
        assert pick.primary == short
        assert pick.fallbacks == (long,)
        pick.lease.release()


def test_default_weighs_kv_without_adding_it_to_counts(pool: Pool, clock: FakeClock) -> None:
    picker, (full, roomy) = pool(2, (0, 10, 0.97), (0, 10, 0.20))
    assert picker.pick("m").primary == roomy


def test_seed_formula_values(pool: Pool, clock: FakeClock) -> None:
    picker, (a, b, c) = pool(3, (3, 2, 0.5), policy="seed")
    assert picker.score(a) == 0 + 2 * 3 + 2 + 10 * 0.5 == 13.0
    lease = picker.pick("m").lease  # goes to b or c (score 0)
    assert lease.endpoint in (b, c)
    assert picker.score(lease.endpoint) == 1.0
    clock.advance(3600)  # seed never ages its samples: that was its flaw
    assert picker.score(a) == 13.0


def test_least_request_uses_only_local_in_flight(pool: Pool, clock: FakeClock) -> None:
    picker, (a, b) = pool(2, policy="least_request")
    observe(picker, clock, a, waiting=100, running=200, kv=1.0)  # ignored
    first = picker.pick("m")
    second = picker.pick("m")
    assert {first.primary, second.primary} == {a, b}
    first.lease.release()
    assert picker.pick("m").primary == first.primary  # now the one with fewer in flight


def test_round_robin_cycles_with_rotating_fallbacks(pool: Pool) -> None:
    picker, (a, b, c) = pool(3, policy="round_robin", fallbacks=1)
    picks = [picker.pick("m") for _ in range(6)]
    assert [p.primary for p in picks] == [a, b, c, a, b, c]
    assert [p.fallbacks for p in picks[:3]] == [(b,), (c,), (a,)]
    assert picker.in_flight(a) == 2  # counted like any other policy


def test_equal_endpoints_share_load(pool: Pool, clock: FakeClock) -> None:
    picker, eps = pool(4, *[(2, 8, 0.4)] * 4)
    chosen: Counter[Endpoint] = Counter()
    for _ in range(400):
        pick = picker.pick("m")
        chosen[pick.primary] += 1
        pick.lease.release()  # scores stay equal, so only the tie-break decides
    assert set(chosen) == set(eps)
    assert min(chosen.values()) > 60


def test_fallbacks_are_distinct_and_ranked(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(fallbacks=3)
    eps = endpoints(6)
    picker.set_endpoints("m", [*eps, eps[0]])  # a duplicate must not become its own fallback
    for i, ep in enumerate(eps):
        observe(picker, clock, ep, waiting=5 - i, running=10, kv=0.1 * (5 - i))
    pick = picker.pick("m")
    ranked = (pick.primary, *pick.fallbacks)
    assert ranked == (eps[5], eps[4], eps[3], eps[2])
    assert len(set(ranked)) == len(ranked)
    assert pick.endpoint_list == ",".join(ep.address for ep in ranked)


def test_fallbacks_capped_by_pool(make_picker: MakePicker) -> None:
    picker = make_picker(fallbacks=4)
    picker.set_endpoints("m", endpoints(2))
    assert len(picker.pick("m").fallbacks) == 1
    picker = make_picker(fallbacks=0)
    picker.set_endpoints("m", endpoints(3))
    assert picker.pick("m").fallbacks == ()


def _graded(picker: Picker, clock: FakeClock, n: int) -> list[Endpoint]:
    eps = endpoints(n)
    picker.set_endpoints("m", eps)
    for i, ep in enumerate(eps):  # eps[0] best ... eps[-1] worst
        observe(picker, clock, ep, waiting=i, running=i, kv=i / n)
    return eps


def test_two_choices_above_threshold(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(fallbacks=2)
    eps = _graded(picker, clock, 40)
    chosen: Counter[Endpoint] = Counter()
    for _ in range(400):
        pick = picker.pick("m")
        chosen[pick.primary] += 1
        assert len({pick.primary, *pick.fallbacks}) == 3
        fallback_scores = [picker.score(f) or 0.0 for f in pick.fallbacks]
        assert fallback_scores == sorted(fallback_scores)
        pick.lease.release()
    assert eps[-1] not in chosen  # the worst never wins a pair
    assert chosen[eps[0]] < 200  # unlike full ranking, the best is not picked every time
    assert len(chosen) > 20  # load spreads over the pool


def test_full_ranking_at_threshold(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker()
    eps = _graded(picker, clock, 32)
    for _ in range(50):
        pick = picker.pick("m")
        assert pick.primary == eps[0]
        pick.lease.release()


def test_threshold_is_configurable(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(p2c_threshold=4)
    eps = _graded(picker, clock, 8)
    primaries = set()
    for _ in range(100):
        pick = picker.pick("m")
        primaries.add(pick.primary)
        pick.lease.release()
    assert len(primaries) > 1 and eps[-1] not in primaries


class _Counting:
    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, s: Signals) -> float:
        self.calls += 1
        return 0.0


def test_two_choices_scores_only_the_drawn(make_picker: MakePicker, clock: FakeClock) -> None:
    spy = _Counting()
    scorers: list[tuple[Scorer, float]] = [(spy, 1.0)]
    picker = make_picker(scorers=scorers, fallbacks=1)
    _graded(picker, clock, 200)
    picker.pick("m")
    assert spy.calls == 3  # two choices plus one extra draw for the second fallback slot


def test_unknown_policy_is_refused(clock: FakeClock) -> None:
    with pytest.raises(ValueError, match="unknown picking policy"):
        Picker(clock, policy="fastest")
