"""Named picking policies. Scored policies rank by score, LOWER IS BETTER."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from modeldock.picking.registry import default_scorers
from modeldock.picking.scorers import InFlight, Scorer, check_weights
from modeldock.picking.signals import Signals
from modeldock.types import Endpoint

POLICY_NAMES = ("default", "seed", "least_request", "round_robin")


class ScoredPolicy(Protocol):
    name: str

    def score(self, s: Signals) -> float: ...


class Weighted:
    """`default`: weighted mean of normalised scorers, in [0, 1].

    Fresh sample:  sum(w_i * scorer_i) / sum(w_i).
    Stale or none: penalty + (1 - penalty) * in_flight scorer. The sample is
    ignored (it may say "idle" about a server that is now busy), the penalty
    ranks the endpoint behind fresh ones that are not clearly loaded, and the
    in-flight term grows with every pick so stale endpoints share load.
    """

    name = "default"

    def __init__(self, scorers: Sequence[tuple[Scorer, float]] | None = None, stale_penalty: float = 0.5,
                 local: Scorer | None = None) -> None:
        scorers = list(scorers) if scorers is not None else default_scorers()
        check_weights(scorers)
        if not 0.0 <= stale_penalty <= 1.0:
            raise ValueError("stale_penalty must be in [0, 1]")
        total = sum(w for _, w in scorers)
        self.scorers = [(scorer, w / total) for scorer, w in scorers]  # pre-normalised weights
        self.stale_penalty = stale_penalty
        self.local = local if local is not None else InFlight()

    def score(self, s: Signals) -> float:
        if not s.fresh:
            return self.stale_penalty + (1.0 - self.stale_penalty) * self.local(s)
        total = 0.0
        for scorer, weight in self.scorers:
            total += weight * scorer(s)
        return min(1.0, total)  # float rounding can overshoot by an ulp


class Seed:
    """`seed`: the first formula, kept for comparison only.

    in_flight + 2*waiting + running + 10*kv on the latest sample as scraped,
    whatever its age and without correction (which is how it chased stale
    "idle" endpoints). Mixes counts and a percentage; do not use in production.
    """

    name = "seed"

    def score(self, s: Signals) -> float:
        sample = s.sample
        if sample is None:
            return float(s.in_flight)
        return s.in_flight + 2.0 * sample.waiting + sample.running + 10.0 * sample.kv


class LeastRequest:
    """`least_request`: this gateway's in-flight count only; ignores samples."""

    name = "least_request"

    def score(self, s: Signals) -> float:
        return float(s.in_flight)


class RoundRobin:
    """`round_robin`: rotate through the candidates, one step per pick, per model."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def order(self, model: str, candidates: Sequence[Endpoint], count: int) -> list[Endpoint]:
        n = len(candidates)
        start = self._next.get(model, 0) % n
        self._next[model] = start + 1
        return [candidates[(start + i) % n] for i in range(min(count, n))]


def make_policy(name: str, scorers: Sequence[tuple[Scorer, float]] | None = None,
                stale_penalty: float = 0.5) -> ScoredPolicy | RoundRobin:
    if name == "default":
        return Weighted(scorers, stale_penalty)
    if name == "seed":
        return Seed()
    if name == "least_request":
        return LeastRequest()
    if name == "round_robin":
        return RoundRobin()
    raise ValueError(f"unknown picking policy {name!r}; known: {', '.join(POLICY_NAMES)}")
