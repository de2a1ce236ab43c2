from __future__ import annotations

from modeldock.clock import FakeClock
from modeldock.config import KubernetesTarget, ModelConfig
from modeldock.discovery.snapshot import SnapshotStore
from modeldock.types import Endpoint
from modeldock.xds.builder import ResourceBuilder
from modeldock.xds.resources import ENDPOINT_TYPE

MODEL = ModelConfig(name="k", kubernetes=KubernetesTarget(namespace="n", service="s", port="http"))


def test_unreported_model_gets_the_cutoff_to_sync_from_server_start() -> None:
    clock = FakeClock()
    store = SnapshotStore(clock)
    builder = ResourceBuilder([MODEL], stale_after=15, started_at=clock.monotonic())
    clock.advance(10)
    assert builder.stale_models(store.current, clock.monotonic()) == frozenset()
    assert builder.age(store.current, "k", clock.monotonic()) == 10
    # Not listed and not stale: no assignment at all, so clients keep what they had.
    assert "model:k" not in builder.build(store.current, clock.monotonic()).of(ENDPOINT_TYPE)
    clock.advance(6)
    assert builder.stale_models(store.current, clock.monotonic()) == {"k"}
    assert "model:k" in builder.build(store.current, clock.monotonic()).of(ENDPOINT_TYPE)
    store.update("k", [Endpoint("10.0.0.1", 80)])
    assert builder.stale_models(store.current, clock.monotonic()) == frozenset()
    resources = builder.build(store.current, clock.monotonic())
    assert "model:k" in resources.of(ENDPOINT_TYPE)


def test_without_a_start_time_an_unreported_model_is_stale() -> None:
    clock = FakeClock()
    builder = ResourceBuilder([MODEL], stale_after=15)
    assert builder.stale_models(SnapshotStore(clock).current, clock.monotonic()) == {"k"}
