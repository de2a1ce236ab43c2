"""Every registered scorer obeys the scoring contract; a new registration without a case here fails."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from picking_helpers import endpoints, observe

from modeldock.clock import FakeClock
from modeldock.picking import Picker
from modeldock.picking.affinity import PrefixAffinity
from modeldock.picking.registry import DEFAULT_WEIGHTS, SCORERS, ScorerOptions, build_scorers, merged_weights
from modeldock.picking.scorers import PickRequest, RequestScorer
from modeldock.picking.signals import Sample, Signals

BLOCKS = tuple(range(101, 109))  # a prompt of 8 blocks
A, B = endpoints(2)


def _signals(**kw: float) -> Signals:
    base = dict(in_flight=0, fresh=True, waiting=0.0, running=0.0, kv=0.0)
    base.update(kw)
    return Signals(fresh=bool(base["fresh"]), sample=Sample(base["waiting"], base["running"], base["kv"]),
                   waiting=base["waiting"], running=base["running"], kv=base["kv"], in_flight=int(base["in_flight"]))


def _load_case(field: str) -> Callable[[RequestScorer, float], float]:
    def score(scorer: RequestScorer, x: float) -> float:
        values = scorer.score(PickRequest("m"), [A], [_signals(**{field: x})])
        assert values is not None
        return values[0]
    return score


def _prefix_case(scorer: RequestScorer, x: float) -> float:
    """x: the share of the prompt's blocks endpoint A has NOT seen (B saw them all)."""
    assert isinstance(scorer, PrefixAffinity)
    seen = len(BLOCKS) - round(x * len(BLOCKS))
    scorer.forget([A, B])
    request = PickRequest("m", BLOCKS)
    scorer.picked(request, B)
    if seen:
        scorer.picked(PickRequest("m", BLOCKS[:seen]), A)
    values = scorer.score(request, [A, B], [_signals(), _signals()])
    assert values is not None
    return values[0]


def _tokens_case(**fixed: float) -> Callable[[RequestScorer, float], float]:
    """x: tokens committed on the endpoint (one request in flight), with `fixed` signals."""
    def score(scorer: RequestScorer, x: float) -> float:
        s = _signals(in_flight=1 if x else 0)._replace(committed=int(x), **fixed)
        values = scorer.score(PickRequest("m"), [A], [s])
        assert values is not None
        return values[0]
    return score


# name -> (how much of its signal, as a strategy; the scorer's value for that much)
CASES: dict[str, tuple[st.SearchStrategy[float], Callable[[RequestScorer, float], float]]] = {
    "queue": (st.integers(0, 10_000).map(float), _load_case("waiting")),
    "running": (st.integers(0, 10_000).map(float), _load_case("running")),
    "in_flight": (st.integers(0, 10_000).map(float), _load_case("in_flight")),
    "kv": (st.integers(0, 1000).map(lambda k: k / 1000), _load_case("kv")),
    "kv_headroom": (st.integers(0, 10_000).map(float), _tokens_case(capacity=10_000.0)),
    "predicted_wait": (st.integers(0, 1_000_000).map(float), _tokens_case(speed=1000.0)),
    "prefix": (st.integers(0, len(BLOCKS)).map(lambda k: k / len(BLOCKS)), _prefix_case),
}


def _make(name: str) -> RequestScorer:
    scorer = SCORERS[name].make(ScorerOptions())
    assert isinstance(scorer, RequestScorer)  # every registered scorer has the one plugin method
    return scorer


def test_every_registered_scorer_has_a_case() -> None:
    assert set(CASES) == set(SCORERS)


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_more_signal_never_ranks_better_and_stays_in_range(name: str) -> None:
    amounts, value_of = CASES[name]
    scorer = _make(name)

    @settings(max_examples=150, deadline=None)
    @given(amounts, amounts)
    def check(x: float, y: float) -> None:
        lo, hi = sorted((x, y))
        a, b = value_of(scorer, lo), value_of(scorer, hi)
        assert 0.0 <= a <= 1.0 and 0.0 <= b <= 1.0
        assert a <= b
        if lo < hi:
            assert a < b, f"{name}: more of its signal ({lo} -> {hi}) did not score worse"

    check()
    assert value_of(scorer, 0.0) == 0.0  # none of the signal: the best value


@pytest.mark.parametrize("name", sorted(SCORERS))
def test_a_stale_sample_is_never_read_as_idle(name: str) -> None:
    """The combined policy with this scorer: a stale endpoint whose last sample said idle never
    scores as well as a fresh idle one, so it never takes the pick. A request scorer runs at its
    default weight beside the load scorers, with the same opinion of both endpoints (both saw the
    prompt), so only staleness tells them apart."""
    clock = FakeClock()
    load_only = {n: 0.0 for n in DEFAULT_WEIGHTS}
    weights = {**load_only, name: 1.0} if SCORERS[name].load else dict(DEFAULT_WEIGHTS)
    picker = Picker(clock, weights=weights, rng=random.Random(3), stale_after=2.0)
    stale, fresh = endpoints(2)
    picker.set_endpoints("m", [stale, fresh])
    observe(picker, clock, stale)  # idle, then it ages
    clock.advance(5.0)
    observe(picker, clock, fresh)
    if not SCORERS[name].load:
        scorer = picker.request_scorer(name)
        assert isinstance(scorer, PrefixAffinity)
        for ep in (stale, fresh):
            scorer.picked(PickRequest("m", BLOCKS), ep)
    stale_score, fresh_score = picker.score(stale), picker.score(fresh)
    assert stale_score is not None and fresh_score is not None and stale_score > fresh_score
    for _ in range(20):
        pick = picker.pick("m", BLOCKS)
        assert pick.primary == fresh
        pick.lease.release()


def test_weights_are_checked_against_the_registry() -> None:
    with pytest.raises(ValueError, match="unknown scorer"):
        merged_weights({"latency": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        merged_weights({"kv": -0.1})
    with pytest.raises(ValueError, match="load scorer"):
        merged_weights({"queue": 0, "kv": 0, "kv_headroom": 0, "running": 0, "in_flight": 0, "predicted_wait": 0})
    assert merged_weights() == DEFAULT_WEIGHTS == {s.name: s.weight for s in SCORERS.values()}
    built = build_scorers({"kv_headroom": 0})
    assert [s.name for s, _ in built.load] == ["queue", "running", "in_flight", "predicted_wait"]
    assert [(s.name, w) for s, w in built.request] == [("prefix", DEFAULT_WEIGHTS["prefix"])]
