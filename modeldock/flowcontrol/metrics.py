"""Prometheus series for the flow-control queues; a no-op when given no registry.

Labels are bounded by config: `model` and `tenant` come from the config file,
`class` from `queue.classes`, `reason` from a fixed set of rejection codes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class QueueMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.enabled = registry is not None
        if registry is None:
            return
        self.length = Gauge(
            "modeldock_queue_length", "Requests waiting in the flow-control queue.",
            ("model", "tenant", "class"), registry=registry,
        )
        self.wait = Histogram(
            "modeldock_queue_wait_seconds", "Time a request waited in the queue before it was dispatched.",
            ("model", "tenant", "class"), buckets=WAIT_BUCKETS, registry=registry,
        )
        self.dispatched = Counter(
            "modeldock_queue_dispatched", "Queued requests handed to an endpoint.",
            ("model", "tenant", "class"), registry=registry,
        )
        self.backfilled = Counter(
            "modeldock_queue_backfilled",
            "Queued requests dispatched past one ahead of them that did not fit (queue.backfill_seconds).",
            ("model", "tenant", "class"), registry=registry,
        )
        self.rejected = Counter(
            "modeldock_queue_rejected",
            "Requests the queue refused or removed: queue_full, queue_timeout, or the dispatch rejection code.",
            ("model", "tenant", "class", "reason"), registry=registry,
        )
        self.cancelled = Counter(
            "modeldock_queue_cancelled", "Queued requests whose client went away before dispatch.",
            ("model", "tenant", "class"), registry=registry,
        )
        self.abandoned = Counter(
            "modeldock_queue_abandoned",
            "Requests dispatched in the same instant their client went away; their claim was released.",
            ("model",), registry=registry,
        )

    def queued(self, model: str, tenant: str, klass: str, delta: int) -> None:
        if self.enabled:
            self.length.labels(model, tenant, klass).inc(delta)

    def on_dispatch(self, model: str, tenant: str, klass: str, waited: float) -> None:
        if self.enabled:
            self.dispatched.labels(model, tenant, klass).inc()
            self.wait.labels(model, tenant, klass).observe(waited)

    def on_backfill(self, model: str, tenant: str, klass: str) -> None:
        if self.enabled:
            self.backfilled.labels(model, tenant, klass).inc()

    def on_reject(self, model: str, tenant: str, klass: str, reason: str) -> None:
        if self.enabled:
            self.rejected.labels(model, tenant, klass, reason).inc()

    def on_cancel(self, model: str, tenant: str, klass: str) -> None:
        if self.enabled:
            self.cancelled.labels(model, tenant, klass).inc()

    def on_abandon(self, model: str) -> None:
        if self.enabled:
            self.abandoned.labels(model).inc()
