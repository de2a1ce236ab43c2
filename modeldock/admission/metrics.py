"""Admission counters: plain attributes always, Prometheus counters when given a registry."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

OUTCOMES = ("admitted", "rate_limited", "concurrency_limited", "unavailable")


class AdmissionMetrics:
    """decisions[outcome], redis_errors and fail_open_passes count since start.

    A fail-open pass is also an `admitted` decision and follows a redis error.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._registry = registry
        self.decisions: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.redis_errors = 0
        self.fail_open_passes = 0
        self._prom_decisions: Counter | None = None
        self._prom_redis_errors: Counter | None = None
        self._prom_fail_open: Counter | None = None
        if registry is not None:
            self._prom_decisions = Counter(
                "modeldock_admission_decisions",
                "Admission decisions by outcome.",
                ["outcome"],
                registry=registry,
            )
            for outcome in OUTCOMES:
                self._prom_decisions.labels(outcome)  # export zeros from the start
            self._prom_redis_errors = Counter(
                "modeldock_admission_redis_errors",
                "Rate-limit calls to Redis that failed or timed out.",
                registry=registry,
            )
            self._prom_fail_open = Counter(
                "modeldock_admission_fail_open",
                "Requests admitted without a Redis check because Redis failed and redis_fail_open is set.",
                registry=registry,
            )

    def track_in_flight(self, read: Callable[[], int]) -> None:
        """Export `modeldock_admission_in_flight`: tickets not yet released, all tenants (read at scrape)."""
        if self._registry is not None:
            Gauge("modeldock_admission_in_flight", "Admitted requests whose ticket is not yet released.",
                  registry=self._registry).set_function(read)

    def decision(self, outcome: str) -> None:
        self.decisions[outcome] += 1
        if self._prom_decisions is not None:
            self._prom_decisions.labels(outcome).inc()

    def redis_error(self) -> None:
        self.redis_errors += 1
        if self._prom_redis_errors is not None:
            self._prom_redis_errors.inc()

    def fail_open(self) -> None:
        self.fail_open_passes += 1
        if self._prom_fail_open is not None:
            self._prom_fail_open.inc()
