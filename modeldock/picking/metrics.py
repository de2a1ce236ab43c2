"""Prometheus metrics for picking and scraping, on a registry the caller owns.

Per-endpoint gauges are computed when Prometheus scrapes (a custom collector),
so a pick pays only for one counter increment and one histogram observation,
and endpoints that leave the snapshot leave the export with them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

OUTCOMES = ("picked", "no_endpoints", "saturated")
PICK_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2)
CADENCES = ("busy", "idle")
ROUND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


class _Noop:
    def inc(self, amount: float = 1.0) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


class EndpointRow(NamedTuple):
    endpoint: str
    in_flight: int
    score: float | None  # None for round_robin, which does not score
    sample_age: float | None  # None when no sample was ever taken
    scrape_failures: int  # consecutive
    committed_tokens: int = 0  # tokens of this gateway's requests in flight there
    capacity_tokens: float = 0.0  # KV capacity read from the page (0: unknown)
    tokens_per_second: float = 0.0  # speed learned from its counters (0: unknown)


class PickerMetrics:
    def __init__(self, registry: CollectorRegistry | None, policy: str,
                 rows: Callable[[], Iterable[EndpointRow]]) -> None:
        self.enabled = registry is not None
        if registry is None:
            noop = _Noop()
            self.outcome: dict[str, _Noop | Counter] = {o: noop for o in OUTCOMES}
            self.latency: _Noop | Histogram = noop
            return
        decisions = Counter("modeldock_picker_decisions", "Pick decisions by outcome and policy.",
                            ["policy", "outcome"], registry=registry)
        self.outcome = {o: decisions.labels(policy=policy, outcome=o) for o in OUTCOMES}  # children cached
        self.latency = Histogram("modeldock_picker_pick_seconds", "Time to choose and count one pick.",
                                 buckets=PICK_BUCKETS, registry=registry)
        registry.register(_EndpointCollector(rows))


class _EndpointCollector(Collector):
    def __init__(self, rows: Callable[[], Iterable[EndpointRow]]) -> None:
        self._rows = rows

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily("modeldock_picker_in_flight", "Requests this gateway has on the endpoint.",
                                      labels=["endpoint"])
        score = GaugeMetricFamily("modeldock_picker_score", "The endpoint's current score (lower is better).",
                                  labels=["endpoint"])
        age = GaugeMetricFamily("modeldock_picker_sample_age_seconds", "Age of the endpoint's last load sample.",
                                labels=["endpoint"])
        failures = GaugeMetricFamily("modeldock_picker_scrape_failures",
                                     "Consecutive failed scrapes of the endpoint.", labels=["endpoint"])
        committed = GaugeMetricFamily("modeldock_picker_committed_tokens",
                                      "Tokens (prompt + output limit) of this gateway's requests in flight there.",
                                      labels=["endpoint"])
        capacity = GaugeMetricFamily("modeldock_picker_kv_capacity_tokens",
                                     "KV-cache capacity in tokens, from vllm:cache_config_info.", labels=["endpoint"])
        speed = GaugeMetricFamily("modeldock_picker_tokens_per_second",
                                  "Tokens per second the endpoint processed while busy (its own counters).",
                                  labels=["endpoint"])
        for row in self._rows():
            in_flight.add_metric([row.endpoint], row.in_flight)
            if row.score is not None:
                score.add_metric([row.endpoint], row.score)
            if row.sample_age is not None:
                age.add_metric([row.endpoint], row.sample_age)
            failures.add_metric([row.endpoint], row.scrape_failures)
            committed.add_metric([row.endpoint], row.committed_tokens)
            if row.capacity_tokens > 0:
                capacity.add_metric([row.endpoint], row.capacity_tokens)
            if row.tokens_per_second > 0:
                speed.add_metric([row.endpoint], row.tokens_per_second)
        yield from (in_flight, score, age, failures, committed, capacity, speed)


class ScrapeMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self._errors: Counter | None = None
        self._refreshes: Counter | None = None
        self._reads: dict[str, Counter] = {}
        self._unchanged: Counter | None = None
        self.round: _Noop | Histogram = _Noop()
        if registry is None:
            return
        self._errors = Counter("modeldock_scrape_errors", "Failed /metrics scrapes by reason.", ["reason"],
                               registry=registry)
        self._refreshes = Counter("modeldock_scrape_refreshes", "Pages read out of turn after a request ended "
                                  "there, by outcome (ok or why no sample).", ["outcome"], registry=registry)
        self._refreshes.labels(outcome="ok")  # exported from the start, at 0
        reads = Counter("modeldock_scrape_reads", "Pages read in the rounds, by the endpoint's cadence (busy: "
                        "this gateway's requests or a queue there; idle: read less often).", ["cadence"],
                        registry=registry)
        self._reads = {cadence: reads.labels(cadence=cadence) for cadence in CADENCES}  # children cached
        self._unchanged = Counter("modeldock_scrape_unchanged", "Reads the server answered 304 Not Modified "
                                  "(its ETag or Last-Modified): the last page applied again.", registry=registry)
        self.round = Histogram("modeldock_scrape_round_seconds", "Wall time of one scrape round.",
                               buckets=ROUND_BUCKETS, registry=registry)

    def error(self, reason: str) -> None:
        if self._errors is not None:
            self._errors.labels(reason=reason).inc()

    def read(self, cadence: str) -> None:
        counter = self._reads.get(cadence)
        if counter is not None:
            counter.inc()

    def unchanged(self) -> None:
        if self._unchanged is not None:
            self._unchanged.inc()

    def refresh(self, outcome: str) -> None:
        if self._refreshes is not None:
            self._refreshes.labels(outcome=outcome).inc()
