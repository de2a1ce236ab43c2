"""Redis calls by operation, and the configured topology, as Prometheus metrics.

One `RedisMetrics` per process registry (never the global one), handed to what calls Redis:

    modeldock_redis_call_seconds{op}      histogram: one awaited call, its queueing in a batch included
    modeldock_redis_call_errors_total{op} counter: calls that failed (refused, reset, timed out, an error reply)
    modeldock_redis_topology{topology}    1 for the configured topology (standalone, sentinel, cluster), else 0

Operations: `rate_window` (admission's sliding window), `token_reserve` and `token_settle` (budgets; a
settlement queued to ride a later write counts its errors only). The load state's exchange keeps its own
`modeldock_sharing_exchange_seconds` and `modeldock_sharing_exchanges_total{outcome}` (sharing README).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["OPERATIONS", "TOPOLOGIES", "RedisMetrics", "topology_of"]

OPERATIONS = ("rate_window", "token_reserve", "token_settle")
TOPOLOGIES = ("standalone", "sentinel", "cluster")
_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


def topology_of(url: str | None, cluster: bool) -> str | None:
    """The topology a `limits.redis_url` and `limits.redis_cluster` name (None: no Redis)."""
    if url is None:
        return None
    if cluster:
        return "cluster"
    return "sentinel" if url.lower().startswith(("redis+sentinel://", "rediss+sentinel://")) else "standalone"


class RedisMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        seconds = Histogram("modeldock_redis_call_seconds", "One awaited Redis call by operation (its wait "
                            "in a batch included)", ["op"], buckets=_BUCKETS, registry=registry)
        errors = Counter("modeldock_redis_call_errors", "Redis calls that failed by operation (refused, reset, "
                         "timed out, an error reply)", ["op"], registry=registry)
        # Children bound once: a labels() lookup per call would cost more than the observation.
        self._seconds = {op: seconds.labels(op) for op in OPERATIONS}
        self._errors = {op: errors.labels(op) for op in OPERATIONS}
        self._topology = Gauge("modeldock_redis_topology", "1 for the configured Redis topology",
                               ["topology"], registry=registry)
        for name in TOPOLOGIES:
            self._topology.labels(name).set(0)

    def observe(self, op: str, seconds: float) -> None:
        self._seconds[op].observe(seconds)

    def error(self, op: str) -> None:
        self._errors[op].inc()

    def set_topology(self, topology: str | None) -> None:
        for name in TOPOLOGIES:
            self._topology.labels(name).set(1 if name == topology else 0)
