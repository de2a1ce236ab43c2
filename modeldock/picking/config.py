"""The `routing:` section: policy, scorer weights, saturation and scraping.

Mounted into the main config as `routing:`. It imports pydantic and nothing else, so the
ground-floor schema (modeldock/config.py) can mount it without loading picking itself
(the package's `__init__` re-exports lazily). The scorer names, their default weights and
which are load scorers are written once, here (`SCORER_DEFAULTS`); registry.py pairs each
with its factory and fails at import when the two tables name different scorers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


@dataclass(frozen=True)
class ScorerDefault:
    name: str
    weight: float  # the default weight; 0 leaves the scorer out unless configured
    load: bool = True  # a load scorer (signals only) or a request scorer
    doc: str = ""


SCORER_DEFAULTS: Mapping[str, ScorerDefault] = {d.name: d for d in (
    ScorerDefault("queue", 0.4, doc="requests waiting, x / (x + 4)"),
    # `kv_headroom` reads the KV fraction itself when no capacity is known, so `kv` is off by default.
    ScorerDefault("kv", 0.0, doc="KV-cache fraction in use"),
    ScorerDefault("kv_headroom", 0.3, doc="KV tokens spoken for (committed, or used + sent since) over capacity"),
    ScorerDefault("running", 0.15, doc="sequences running, x / (x + 32)"),
    ScorerDefault("in_flight", 0.15, doc="this gateway's requests, x / (x + 8)"),
    ScorerDefault("predicted_wait", 0.1, doc="committed tokens / the endpoint's own tokens per second, x / (x + 2 s)"),
    ScorerDefault("prefix", 0.25, load=False, doc="prefix-cache miss fraction, beside the load scorers' total of 1"),
)}

DEFAULT_WEIGHTS: Mapping[str, float] = {name: d.weight for name, d in SCORER_DEFAULTS.items()}


def load_scorer_names() -> list[str]:
    return [name for name, d in SCORER_DEFAULTS.items() if d.load]


def merged_weights(weights: Mapping[str, float] | None = None) -> dict[str, float]:
    """`weights` over the defaults; ValueError naming any unknown scorer or a bad value."""
    merged = {**DEFAULT_WEIGHTS, **(weights or {})}
    unknown = sorted(set(merged) - set(SCORER_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown scorer weights {unknown}; known: {sorted(SCORER_DEFAULTS)}")
    negative = sorted(name for name, w in merged.items() if not w >= 0)
    if negative:
        raise ValueError(f"scorer weights must be >= 0: {negative}")
    if sum(w for name, w in merged.items() if SCORER_DEFAULTS[name].load) <= 0:
        raise ValueError(f"at least one load scorer weight must be above 0 ({', '.join(load_scorer_names())})")
    return merged


# `routing.weights`: every scorer's weight, the defaults filled in; an unknown name is an error
# naming the field.
WeightsConfig = Annotated[dict[str, float], AfterValidator(merged_weights)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SaturationConfig(_Section):
    # Room (picking/saturation.py): an endpoint is full when one more request would not fit.
    room: bool = True
    kv_full: Annotated[float, Field(gt=0, le=1)] = 0.9  # with requests waiting, KV this full is full
    stale_max_in_flight: Annotated[int, Field(ge=1)] | None = None  # stale sample: full at this many
    # Fixed thresholds on a fresh sample (off unless set).
    max_waiting: Annotated[int, Field(ge=1)] | None = None
    max_kv: Annotated[float, Field(gt=0, le=1)] | None = None
    reject: Literal["rate_limited", "unavailable"] = "rate_limited"
    retry_after_seconds: Annotated[int, Field(ge=1)] = 1


class ScrapeConfig(_Section):
    interval_seconds: Annotated[float, Field(gt=0, le=10)] = 0.5
    timeout_seconds: Annotated[float, Field(gt=0, le=10)] = 0.5
    budget_seconds: Annotated[float, Field(gt=0, le=10)] = 2.0
    path: str = "/metrics"
    # A request ending on an endpoint reads its page again out of turn (the last page still counts
    # the KV it held), at most once per this many seconds per endpoint; 0 turns it off.
    refresh_gap_seconds: Annotated[float, Field(ge=0, le=10)] = 0.05
    # An endpoint with nothing of this gateway's in flight and no queue for its model is read this
    # often instead (0: every endpoint every interval). None: derived from the stale cutoff
    # (`RoutingConfig.idle_interval`). Given, it must keep the sample fresh between two reads.
    idle_interval_seconds: Annotated[float, Field(ge=0, le=60)] | None = None


# How far inside the stale cutoff an idle endpoint's sample stays (the event loop's lag, a slow read).
IDLE_MARGIN_SECONDS = 0.25
# The derived idle interval stays below vLLM's keep-alive (uvicorn closes a connection idle for 5 s).
IDLE_INTERVAL_CAP_SECONDS = 4.0


class RoutingConfig(_Section):
    policy: Literal["default", "seed", "least_request", "round_robin"] = "default"
    fallbacks: Annotated[int, Field(ge=0, le=4)] = 2
    weights: WeightsConfig = Field(default_factory=lambda: merged_weights())
    stale_after_seconds: Annotated[float, Field(gt=0)] = 2.0  # metrics samples older than this are not trusted
    stale_penalty: Annotated[float, Field(ge=0, le=1)] = 0.5
    p2c_threshold: Annotated[int, Field(ge=2)] = 32
    saturation: SaturationConfig = SaturationConfig()
    scrape: ScrapeConfig = ScrapeConfig()

    @model_validator(mode="after")
    def _idle_reads_stay_fresh(self) -> RoutingConfig:
        idle, scrape = self.scrape.idle_interval_seconds, self.scrape
        if idle is not None and idle > scrape.interval_seconds and (
                idle + scrape.timeout_seconds + IDLE_MARGIN_SECONDS > self.stale_after_seconds):
            raise ValueError(
                f"scrape.idle_interval_seconds ({idle:g}) + scrape.timeout_seconds ({scrape.timeout_seconds:g}) "
                f"+ {IDLE_MARGIN_SECONDS:g} s must not exceed stale_after_seconds ({self.stale_after_seconds:g}): "
                "an idle endpoint's sample would go stale between two reads")
        return self

    @property
    def idle_interval(self) -> float:
        """Seconds between reads of an idle endpoint (at most the interval: adaptive reads are off).
        Derived unless given: as long as the stale cutoff allows, less one read's timeout and the margin,
        at most IDLE_INTERVAL_CAP_SECONDS."""
        scrape = self.scrape
        idle = scrape.idle_interval_seconds
        if idle is None:
            idle = min(IDLE_INTERVAL_CAP_SECONDS,
                       self.stale_after_seconds - scrape.timeout_seconds - IDLE_MARGIN_SECONDS)
        return max(scrape.interval_seconds, idle)
