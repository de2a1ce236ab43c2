"""Scorers: each maps one endpoint to [0, 1], where LOWER IS BETTER.

Two shapes share one plugin method, `score(request, endpoints, signals)`:

- load scorers (`SignalScorer`, `load = True`) read one endpoint's signals and
  nothing else, so they are also callable as `scorer(signals)`; the `default`
  policy sums them per endpoint and, for a stale sample, replaces them all with
  the stale rule (policies.py);
- request scorers (`load = False`, e.g. prefix affinity in affinity.py) see the
  request too and may have no opinion on it (None).

Counts are normalised with a saturating curve x / (x + half), which is 0 at
idle, 0.5 at `half` and approaches 1 under any load. It needs no view of the
other candidates, so power-of-two-choices can score just two endpoints.
KV usage is already a 0..1 fraction. Weighted sums of these stay in [0, 1],
so a percentage is never added to a request count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from modeldock.picking.signals import Signals
from modeldock.types import Endpoint


@dataclass(frozen=True, slots=True)
class PickRequest:
    """What a scorer may know about the request being placed."""

    model: str
    prefix_blocks: tuple[int, ...] = ()  # prefix.prompt_blocks of the prompt
    cost: int = 0  # estimated tokens: prompt + output limit (flowcontrol.cost.estimate_cost)
    # Its standing: slots (and tokens; None: the capacity's share of those slots) it must leave free
    # on an endpoint for protected requests (saturation.py); 0 for a protected request.
    headroom: int = 0
    headroom_tokens: int | None = None
    # A protected request while others must leave it room: among near ties it takes a fast endpoint
    # (scheduler._least_recent), as its class or share is what the contention is decided by.
    prefer_fast: bool = False
    # Its output limit (max_tokens), the part of `cost` that grows while it runs; None: unknown (all of it).
    output: int | None = None


class Scorer(Protocol):
    """A load scorer: one endpoint's signals -> [0, 1], lower is better."""

    name: str

    def __call__(self, s: Signals) -> float:
        """A value in [0, 1]; lower is better."""


@runtime_checkable
class RequestScorer(Protocol):
    """A scorer that sees the request: one value per endpoint, or None for no opinion
    on this request (its weight is then left out, so the others decide alone)."""

    name: str
    load: bool

    def score(self, request: PickRequest, endpoints: Sequence[Endpoint],
              signals: Sequence[Signals]) -> Sequence[float] | None: ...


def saturating(x: float, half: float) -> float:
    """x / (x + half), clamped below at 0: 0 when idle, 0.5 at `half`, < 1 always."""
    return x / (x + half) if x > 0 else 0.0


class SignalScorer:
    """Base of the load scorers: `score` is `__call__` over each endpoint's signals."""

    name = ""
    load = True

    def __call__(self, s: Signals) -> float:
        raise NotImplementedError

    def score(self, request: PickRequest, endpoints: Sequence[Endpoint],
              signals: Sequence[Signals]) -> Sequence[float] | None:
        return [self(s) for s in signals]


class QueueDepth(SignalScorer):
    """Requests waiting in the server's queue: the strongest sign of overload."""

    name = "queue"

    def __init__(self, half: float = 4.0) -> None:
        self.half = half

    def __call__(self, s: Signals) -> float:
        return saturating(s.waiting, self.half)


class Running(SignalScorer):
    """Sequences in the running batch: more means slower tokens for each."""

    name = "running"

    def __init__(self, half: float = 32.0) -> None:
        self.half = half

    def __call__(self, s: Signals) -> float:
        return saturating(s.running, self.half)


class KvUsage(SignalScorer):
    """KV-cache fraction in use: near 1 the server starts preempting."""

    name = "kv"

    def __call__(self, s: Signals) -> float:
        return min(1.0, max(0.0, s.kv))


class InFlight(SignalScorer):
    """Requests this gateway has on the endpoint now: always current, never stale."""

    name = "in_flight"

    def __init__(self, half: float = 8.0) -> None:
        self.half = half

    def __call__(self, s: Signals) -> float:
        return saturating(s.in_flight, self.half)


def check_weights(scorers: Sequence[tuple[Scorer, float]]) -> None:
    if not scorers or any(w < 0 for _, w in scorers) or sum(w for _, w in scorers) <= 0:
        raise ValueError("scorer weights must be >= 0 with a positive sum")
