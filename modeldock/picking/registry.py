"""Every scorer by name: its default weight and kind (from picking/config.py) with its factory.

`routing.weights` is validated against `SCORER_DEFAULTS` (config.py, which the ground-floor
schema mounts without loading this module), and `Picker` builds its scorers here. Adding a
scorer: write it in a new module (a `SignalScorer` subclass for a load signal, or a class with
`name`, `load = False` and `score(request, endpoints, signals)` for one that sees the request),
then add its line to `SCORER_DEFAULTS` (config.py) and its factory to `_FACTORIES` below; the
import fails while the two tables disagree. README.md shows an example.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from modeldock.picking.affinity import PrefixAffinity
from modeldock.picking.config import DEFAULT_WEIGHTS, SCORER_DEFAULTS, load_scorer_names, merged_weights
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


# Each scorer's factory; its name, default weight and kind are in config.py (`SCORER_DEFAULTS`).
_FACTORIES: Mapping[str, Callable[[ScorerOptions], Scorer | RequestScorer]] = {
    "queue": lambda _: QueueDepth(),
    "kv": lambda _: KvUsage(),
    "kv_headroom": lambda _: KvHeadroom(),
    "running": lambda _: Running(),
    "in_flight": lambda _: InFlight(),
    "predicted_wait": lambda _: PredictedWait(),
    "prefix": lambda o: PrefixAffinity(o.prefix_capacity),
}

if set(_FACTORIES) != set(SCORER_DEFAULTS):  # a scorer added to one table only: fail at import, loudly
    raise RuntimeError(f"scorer tables disagree: factories {sorted(_FACTORIES)}, config {sorted(SCORER_DEFAULTS)}")

SCORERS: Mapping[str, ScorerSpec] = {
    name: ScorerSpec(name, d.weight, _FACTORIES[name], d.load, d.doc) for name, d in SCORER_DEFAULTS.items()
}


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


def default_scorers(weights: Mapping[str, float] | None = None) -> list[tuple[Scorer, float]]:
    """The registered load scorers with `weights` (by scorer name) over the defaults."""
    return build_scorers(weights).load


__all__ = ["DEFAULT_WEIGHTS", "SCORERS", "BuiltScorers", "ScorerOptions", "ScorerSpec", "build_scorers",
           "default_scorers", "load_scorer_names", "merged_weights"]
