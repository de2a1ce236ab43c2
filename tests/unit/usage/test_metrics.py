"""Token counters per tenant and model, and the cap on distinct label sets."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from usage_helpers import record

from modeldock.usage import UsageMetrics


def tokens(registry: CollectorRegistry, tenant: str, model: str, kind: str) -> float | None:
    return registry.get_sample_value("modeldock_tokens_total", {"tenant": tenant, "model": model, "kind": kind})


def test_prompt_and_completion_tokens_per_tenant_and_model() -> None:
    registry = CollectorRegistry()
    metrics = UsageMetrics(registry)
    metrics.observe(record(prompt_tokens=10, completion_tokens=3))
    metrics.observe(record(prompt_tokens=5, completion_tokens=0, token_source="estimated"))
    metrics.observe(record(tenant="beta", prompt_tokens=7, completion_tokens=2))
    assert tokens(registry, "acme", "llama-8b", "prompt") == 15
    assert tokens(registry, "acme", "llama-8b", "completion") == 3
    assert tokens(registry, "beta", "llama-8b", "prompt") == 7
    assert registry.get_sample_value("modeldock_tokens_estimated_total",
                                     {"tenant": "acme", "model": "llama-8b", "kind": "prompt"}) == 5


def test_label_sets_are_capped_then_go_to_other() -> None:
    registry = CollectorRegistry()
    metrics = UsageMetrics(registry, max_label_sets=3)
    for i in range(10):
        metrics.observe(record(tenant=f"t{i}", prompt_tokens=1, completion_tokens=1))
    metrics.observe(record(tenant="t1", prompt_tokens=4, completion_tokens=1))  # already seen: own series
    series = {s.labels["tenant"] for m in registry.collect() if m.name == "modeldock_tokens"
              for s in m.samples if s.name == "modeldock_tokens_total"}
    assert series == {"t0", "t1", "t2", "other"}
    assert tokens(registry, "t1", "llama-8b", "prompt") == 5
    assert tokens(registry, "other", "other", "prompt") == 7
    assert registry.get_sample_value("modeldock_usage_label_overflow_total") == 7
    # A new model for a known tenant is a new label set too.
    metrics.observe(record(tenant="t0", model="other-model", prompt_tokens=1))
    assert tokens(registry, "t0", "other-model", "prompt") is None
    assert tokens(registry, "other", "other", "prompt") == 8


def test_no_registry_records_nothing_and_cap_must_be_positive() -> None:
    UsageMetrics(None).observe(record())
    with pytest.raises(ValueError, match="at least 1"):
        UsageMetrics(None, max_label_sets=0)
