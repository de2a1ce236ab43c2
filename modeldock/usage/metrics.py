"""Prometheus counters of tokens per tenant and model, with a cap on label sets.

Tenants and models come from config, so the label sets are bounded already; the cap
guards against a bug or a huge config turning into unbounded series: once `max_label_sets`
distinct (tenant, model) pairs have been seen, new pairs are counted under
tenant="other", model="other" (and `modeldock_usage_label_overflow_total` counts them).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from modeldock.usage.record import UsageRecord

OTHER = "other"


class UsageMetrics:
    def __init__(self, registry: CollectorRegistry | None, max_label_sets: int = 2000) -> None:
        if max_label_sets < 1:
            raise ValueError("max_label_sets must be at least 1")
        self.enabled = registry is not None
        self.max_label_sets = max_label_sets
        self._seen: set[tuple[str, str]] = set()
        if registry is None:
            return
        self.tokens = Counter(
            "modeldock_tokens", "Tokens used, by tenant, public model and kind (prompt or completion).",
            ("tenant", "model", "kind"), registry=registry,
        )
        self.estimated = Counter(
            "modeldock_tokens_estimated",
            "Tokens in modeldock_tokens_total that the gateway estimated because the backend reported none.",
            ("tenant", "model", "kind"), registry=registry,
        )
        self.records = Counter(
            "modeldock_usage_records", "Usage records written.", registry=registry,
        )
        self.write_errors = Counter(
            "modeldock_usage_write_errors", "Usage records lost because the file could not be written.",
            registry=registry,
        )
        self.overflow = Counter(
            "modeldock_usage_label_overflow",
            "Records counted under tenant=\"other\", model=\"other\" because max_label_sets was reached.",
            registry=registry,
        )

    def labels_for(self, tenant: str, model: str) -> tuple[str, str] | None:
        """The (tenant, model) labels while under the cap; None once the cap is reached for a new pair."""
        key = (tenant, model)
        if key in self._seen:
            return key
        if len(self._seen) < self.max_label_sets:
            self._seen.add(key)
            return key
        return None

    def observe(self, record: UsageRecord) -> None:
        """Count the record's tokens (whether or not the record could be written: they were used)."""
        if not self.enabled:
            return
        labels = self.labels_for(record.tenant, record.model)
        if labels is None:
            labels = (OTHER, OTHER)
            self.overflow.inc()
        tenant, model = labels
        if record.prompt_tokens:
            self.tokens.labels(tenant, model, "prompt").inc(record.prompt_tokens)
        if record.completion_tokens:
            self.tokens.labels(tenant, model, "completion").inc(record.completion_tokens)
        if record.token_source == "estimated":
            if record.prompt_tokens:
                self.estimated.labels(tenant, model, "prompt").inc(record.prompt_tokens)
            if record.completion_tokens:
                self.estimated.labels(tenant, model, "completion").inc(record.completion_tokens)

    def written(self) -> None:
        if self.enabled:
            self.records.inc()

    def write_error(self) -> None:
        if self.enabled:
            self.write_errors.inc()
