"""Scorers: each maps one endpoint's signals to [0, 1], where LOWER IS BETTER.

Counts are normalised with a saturating curve x / (x + half), which is 0 at
idle, 0.5 at `half` and approaches 1 under any load. It needs no view of the
other candidates, so power-of-two-choices can score just two endpoints.
KV usage is already a 0..1 fraction. Weighted sums of these stay in [0, 1],
so a percentage is never added to a request count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from modeldock.picking.signals import Signals


class Scorer(Protocol):
    name: str

    def __call__(self, s: Signals) -> float:
        """A value in [0, 1]; lower is better."""


def saturating(x: float, half: float) -> float:
    """x / (x + half), clamped below at 0: 0 when idle, 0.5 at `half`, < 1 always."""
    return x / (x + half) if x > 0 else 0.0


class QueueDepth:
    """Requests waiting in the server's queue: the strongest sign of overload."""

    name = "queue"

    def __init__(self, half: float = 4.0) -> None:
        self.half = half

    def __call__(self, s: Signals) -> float:
        return saturating(s.waiting, self.half)


class Running:
    """Sequences in the running batch: more means slower tokens for each."""

    name = "running"

    def __init__(self, half: float = 32.0) -> None:
        self.half = half

    def __call__(self, s: Signals) -> float:
        return saturating(s.running, self.half)


class KvUsage:
    """KV-cache fraction in use: near 1 the server starts preempting."""

    name = "kv"

    def __call__(self, s: Signals) -> float:
        return min(1.0, max(0.0, s.kv))


class InFlight:
    """Requests this gateway has on the endpoint now: always current, never stale."""

    name = "in_flight"

    def __init__(self, half: float = 8.0) -> None:
        self.half = half

    def __call__(self, s: Signals) -> float:
        return saturating(s.in_flight, self.half)


DEFAULT_WEIGHTS: Mapping[str, float] = {"queue": 0.4, "kv": 0.3, "running": 0.15, "in_flight": 0.15}


def default_scorers(weights: Mapping[str, float] | None = None) -> list[tuple[Scorer, float]]:
    """The built-in scorers with `weights` (by scorer name) over the defaults."""
    merged = {**DEFAULT_WEIGHTS, **(weights or {})}
    unknown = set(merged) - set(DEFAULT_WEIGHTS)
    if unknown:
        raise ValueError(f"unknown scorer weights {sorted(unknown)}; known: {sorted(DEFAULT_WEIGHTS)}")
    built: list[Scorer] = [QueueDepth(), KvUsage(), Running(), InFlight()]
    return [(scorer, merged[scorer.name]) for scorer in built if merged[scorer.name] > 0]


def check_weights(scorers: Sequence[tuple[Scorer, float]]) -> None:
    if not scorers or any(w < 0 for _, w in scorers) or sum(w for _, w in scorers) <= 0:
        raise ValueError("scorer weights must be >= 0 with a positive sum")
