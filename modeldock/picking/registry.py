"""Every scorer by name, with its default weight and a factory: the one place both are written.

`routing.weights` (config.py) is validated against this table, and `Picker`
builds its scorers from it. Adding a scorer: write it in a new module (a
`SignalScorer` subclass for a load signal, or a class with `name`, `load = False`
and `score(request, endpoints, signals)` for one that sees the request), then
add one `ScorerSpec` line to `SCORERS` below. README.md shows an example.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from modeldock.picking.affinity import PrefixAffinity
from modeldock.picking.headroom import KvHeadroom
from modeldock.picking.scorers import InFlight, KvUsage, QueueDepth, RequestScorer, Running, Scorer
from modeldock.picking.wait import PredictedWait


@dataclass(frozen=True)
class ScorerOptions:
    """Settings a factory may read (not weights: those are per scorer)."""

    prefix_capacity: int = 200_000  # block hashes the prefix index remembers


@dataclass(frozen=True)
class ScorerSpec:
    name: str
    weight: float  # the default weight; 0 leaves the scorer out unless configured
    make: Callable[[ScorerOptions], Scorer | RequestScorer]
    load: bool = True  # a load scorer (signals only) or a request scorer
    doc: str = ""


SCORERS: Mapping[str, ScorerSpec] = {spec.name: spec for spec in (
    ScorerSpec("queue", 0.4, lambda _: QueueDepth(), doc="requests waiting, x / (x + 4)"),
    # `kv_headroom` reads the KV fraction itself when no capacity is known, so `kv` is off by default.
    ScorerSpec("kv", 0.0, lambda _: KvUsage(), doc="KV-cache fraction in use"),
    ScorerSpec("kv_headroom", 0.3, lambda _: KvHeadroom(),
               doc="KV tokens spoken for (committed, or used + sent since) over capacity"),
    ScorerSpec("running", 0.15, lambda _: Running(), doc="sequences running, x / (x + 32)"),
    ScorerSpec("in_flight", 0.15, lambda _: InFlight(), doc="this gateway's requests, x / (x + 8)"),
    ScorerSpec("predicted_wait", 0.1, lambda _: PredictedWait(),
               doc="committed tokens / the endpoint's own tokens per second, x / (x + 2 s)"),
    ScorerSpec("prefix", 0.25, lambda o: PrefixAffinity(o.prefix_capacity), load=False,
               doc="prefix-cache miss fraction, beside the load scorers' total of 1"),
)}

DEFAULT_WEIGHTS: Mapping[str, float] = {name: spec.weight for name, spec in SCORERS.items()}


def merged_weights(weights: Mapping[str, float] | None = None) -> dict[str, float]:
    """`weights` over the defaults; ValueError naming any unknown scorer or a bad value."""
    merged = {**DEFAULT_WEIGHTS, **(weights or {})}
    unknown = sorted(set(merged) - set(SCORERS))
    if unknown:
        raise ValueError(f"unknown scorer weights {unknown}; known: {sorted(SCORERS)}")
    negative = sorted(name for name, w in merged.items() if not w >= 0)
    if negative:
        raise ValueError(f"scorer weights must be >= 0: {negative}")
    if sum(w for name, w in merged.items() if SCORERS[name].load) <= 0:
        raise ValueError(f"at least one load scorer weight must be above 0 ({', '.join(load_scorer_names())})")
    return merged


def load_scorer_names() -> list[str]:
    return [name for name, spec in SCORERS.items() if spec.load]


@dataclass
class BuiltScorers:
    load: list[tuple[Scorer, float]] = field(default_factory=list)
    request: list[tuple[RequestScorer, float]] = field(default_factory=list)


def build_scorers(weights: Mapping[str, float] | None = None,
                  options: ScorerOptions = ScorerOptions()) -> BuiltScorers:
    """Every registered scorer with a weight above 0, in registry order."""
    built = BuiltScorers()
    for name, w in merged_weights(weights).items():
        spec = SCORERS[name]
        if w <= 0:
            continue
        scorer = spec.make(options)
        if spec.load:
            built.load.append((scorer, w))  # type: ignore[arg-type]
        else:
            assert isinstance(scorer, RequestScorer)
            built.request.append((scorer, w))
    return built
