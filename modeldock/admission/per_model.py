"""Which per-model rate limit applies to a request, and which window it counts in.

The window is keyed by the model's served (upstream) name: what actually reaches the
backend. So a public alias whose `served_name` is a limited model shares that model's
window, and cannot be used to get around its limit.

A key of `requests_per_minute_per_model` is a name or a glob (as in allowlists). It
covers every served name of a model it matches, by public or served name. When
several keys cover one served name, every one applies; since they count in the one
window of that served name, the lowest limit is the one that binds.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from modeldock.config import Config, ModelConfig, TenantConfig


@dataclass(frozen=True, slots=True)
class ModelLimit:
    """The per-model limit for a request: `limit` requests per window on the served name `upstream`.
    limit 0: no per-model limit."""

    upstream: str
    limit: int


def per_model_limits(tenant: TenantConfig, models: Iterable[ModelConfig]) -> dict[str, ModelLimit]:
    """Public model name -> its ModelLimit, for every configured model."""
    models = list(models)
    by_upstream: dict[str, int] = {}
    for pattern, limit in tenant.requests_per_minute_per_model.items():
        for model in models:
            if model.matches(pattern):
                current = by_upstream.get(model.upstream_name)
                by_upstream[model.upstream_name] = limit if current is None else min(current, limit)
    return {m.name: ModelLimit(m.upstream_name, by_upstream.get(m.upstream_name, 0)) for m in models}


class PerModelLimits:
    """Per-tenant tables built once per config; `lookup` is a dict lookup on the request path."""

    def __init__(self, config: Config) -> None:
        self._models = tuple(config.models)
        self._tables: dict[str, tuple[TenantConfig, Mapping[str, ModelLimit]]] = {
            t.id: (t, per_model_limits(t, self._models)) for t in config.tenants
        }

    def lookup(self, tenant: TenantConfig, model: str) -> ModelLimit:
        entry = self._tables.get(tenant.id)
        if entry is None or entry[0] is not tenant:
            # A TenantConfig from another config than the one these tables were built from.
            entry = (tenant, per_model_limits(tenant, self._models))
            self._tables[tenant.id] = entry
        found = entry[1].get(model)
        if found is not None:
            return found
        # Not a configured model (the gateway refuses those before admission): match the name itself.
        limits = [
            n for pattern, n in tenant.requests_per_minute_per_model.items() if fnmatch.fnmatchcase(model, pattern)
        ]
        return ModelLimit(model, min(limits, default=0))

