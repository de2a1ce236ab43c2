"""Redis calls by operation and the configured topology, on the registry ext_proc exports."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from modeldock.admission.limits import Admission
from modeldock.budgets.budgets import TokenBudgets
from modeldock.budgets.tokens import Usage
from modeldock.clock import SystemClock
from modeldock.errors import Unavailable
from modeldock.redis_metrics import RedisMetrics, topology_of
from tests.support.redis_server import RedisServer
from tests.unit.admission.admission_helpers import config, tenant

pytestmark = pytest.mark.timeout(60)


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_each_operation_is_timed_and_its_failures_counted(redis_server: RedisServer) -> None:
    registry = CollectorRegistry()
    metrics = RedisMetrics(registry)
    acme = tenant("acme", rpm=100, tokens_per_minute=100_000)
    cfg = config(acme, redis_url=redis_server.url, redis_timeout_ms=1000, token_lease_ms=0)

    async def run() -> None:
        admission = Admission(cfg, SystemClock(), redis_metrics=metrics)
        budgets = TokenBudgets(cfg, SystemClock(), redis_metrics=metrics)
        try:
            for i in range(3):
                (await admission.admit(acme, "m")).release()
                reservation = await budgets.reserve(acme, "m", 50, f"r{i}")
                reservation.finish_nowait(reached_backend=True, usage=Usage(prompt_tokens=10, completion_tokens=5))
            await budgets.flush()
            redis_server.stop()
            with pytest.raises(Unavailable):
                await admission.admit(acme, "m")
        finally:
            await admission.close()
            await budgets.close()

    asyncio.run(run())
    assert _value(registry, "modeldock_redis_call_seconds_count", op="rate_window") == 3
    assert _value(registry, "modeldock_redis_call_seconds_count", op="token_reserve") == 3
    assert _value(registry, "modeldock_redis_call_seconds_sum", op="rate_window") > 0
    assert _value(registry, "modeldock_redis_call_errors_total", op="rate_window") == 1
    assert _value(registry, "modeldock_redis_call_errors_total", op="token_reserve") == 0


@pytest.mark.parametrize(
    ("url", "cluster", "topology"),
    [("redis://h/0", False, "standalone"), ("unix:///run/r.sock", False, "standalone"),
     ("REDIS+SENTINEL://s1/m", False, "sentinel"), ("redis://h/0", True, "cluster"), (None, False, None)],
)
def test_the_topology_gauge_names_the_configured_one(url: str | None, cluster: bool, topology: str | None) -> None:
    registry = CollectorRegistry()
    metrics = RedisMetrics(registry)
    metrics.set_topology(topology_of(url, cluster))
    values = {name: _value(registry, "modeldock_redis_topology", topology=name)
              for name in ("standalone", "sentinel", "cluster")}
    assert values == {name: (1.0 if name == topology else 0.0) for name in values}
