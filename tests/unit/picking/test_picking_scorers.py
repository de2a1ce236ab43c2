from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modeldock.picking.policies import Weighted
from modeldock.picking.registry import default_scorers
from modeldock.picking.scorers import InFlight, KvUsage, QueueDepth, Running, saturating
from modeldock.picking.signals import Sample, Signals

counts = st.floats(min_value=0, max_value=1e9, allow_nan=False)
signals = st.builds(
    Signals,
    in_flight=st.integers(0, 10**6),
    fresh=st.booleans(),
    waiting=counts,
    running=counts,
    kv=st.floats(min_value=-1, max_value=2, allow_nan=False),
    sample=st.none() | st.builds(Sample, counts, counts, st.floats(0, 1)),
)
halves = st.floats(min_value=0.01, max_value=1e4)


@given(signals, halves)
def test_each_scorer_is_normalised(s: Signals, half: float) -> None:
    for scorer in (QueueDepth(half), Running(half), KvUsage(), InFlight(half)):
        assert 0.0 <= scorer(s) <= 1.0, scorer.name


@given(signals, st.floats(0, 1), st.dictionaries(st.sampled_from(["queue", "kv", "running", "in_flight"]),
                                                  st.floats(0.01, 100)))
def test_weighted_score_is_normalised(s: Signals, penalty: float, weights: dict[str, float]) -> None:
    score = Weighted(default_scorers(weights), stale_penalty=penalty).score(s)
    assert 0.0 <= score <= 1.0


@given(st.floats(0, 1e6), st.floats(0, 1e6), halves)
def test_saturating_is_monotonic(a: float, b: float, half: float) -> None:
    lo, hi = sorted((a, b))
    assert saturating(lo, half) <= saturating(hi, half)


def test_saturating_shape() -> None:
    assert saturating(0, 4) == 0.0
    assert saturating(4, 4) == 0.5
    assert saturating(12, 4) == 0.75


def test_stale_score_uses_only_in_flight_plus_penalty() -> None:
    policy = Weighted(stale_penalty=0.5)
    idle_sample = Sample(waiting=0, running=0, kv=0)
    busy_sample = Sample(waiting=50, running=200, kv=1)
    a = policy.score(Signals(in_flight=8, fresh=False, sample=idle_sample))
    b = policy.score(Signals(in_flight=8, fresh=False, sample=busy_sample))
    assert a == b == pytest.approx(0.5 + 0.5 * 0.5)  # in_flight 8 is the scorer's half point
    fresh_idle = policy.score(Signals(in_flight=0, fresh=True, sample=idle_sample))
    stale_idle = policy.score(Signals(in_flight=0, fresh=False, sample=idle_sample))
    assert fresh_idle == 0.0 and stale_idle == 0.5  # a stale "idle" is not idle


def test_weights_validation() -> None:
    with pytest.raises(ValueError, match="unknown scorer"):
        default_scorers({"latency": 1.0})
    no_extras = default_scorers({"kv_headroom": 0, "predicted_wait": 0})
    assert [s.name for s, _ in no_extras] == ["queue", "running", "in_flight"]
    with pytest.raises(ValueError):
        Weighted([], 0.5)
    with pytest.raises(ValueError):
        Weighted(stale_penalty=1.5)
