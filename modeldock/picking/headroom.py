"""KV headroom: how much of an endpoint's KV cache is spoken for, counted in tokens."""

from __future__ import annotations

from modeldock.picking.scorers import SignalScorer
from modeldock.picking.signals import Signals


class KvHeadroom(SignalScorer):
    """The share of the endpoint's KV capacity (vllm:cache_config_info) that is spoken for:
    the larger of the tokens this gateway has committed there (prompt + output limit of its
    requests in flight: what they may still grow to) and the sample's used KV plus the tokens
    of requests sent since the sample (what is in the cache now, with what is on its way).
    Clamped to [0, 1]. Without a capacity reading, the sample's KV fraction (the `kv` scorer)."""

    name = "kv_headroom"

    def __call__(self, s: Signals) -> float:
        capacity = s.capacity
        if capacity <= 0:
            return min(1.0, max(0.0, s.kv))
        demand = max(float(s.committed), s.kv * capacity + s.new_tokens)
        return min(1.0, max(0.0, demand / capacity))
