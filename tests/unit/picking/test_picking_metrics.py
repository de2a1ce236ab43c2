from __future__ import annotations

import random
import statistics
import time

import pytest
from picking_helpers import endpoints, observe
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from modeldock.clock import FakeClock
from modeldock.errors import RateLimited, Unavailable
from modeldock.picking import Picker, Sample, Saturation


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_exports_decisions_latency_and_per_endpoint_state(clock: FakeClock) -> None:
    registry = CollectorRegistry()
    picker = Picker(clock, registry=registry, saturation=Saturation(max_waiting=5), rng=random.Random(1))
    a, b = endpoints(2)
    picker.set_endpoints("m", [a, b])
    observe(picker, clock, a, waiting=1, running=3, kv=0.2)
    picker.observe_failure(b)
    clock.advance(0.25)
    lease = picker.pick("m").lease
    with pytest.raises(Unavailable):
        picker.pick("other")
    observe(picker, clock, a, waiting=9)
    observe(picker, clock, b, waiting=9)
    with pytest.raises(RateLimited):
        picker.pick("m")

    decisions = "modeldock_picker_decisions_total"
    assert _value(registry, decisions, policy="default", outcome="picked") == 1
    assert _value(registry, decisions, policy="default", outcome="no_endpoints") == 1
    assert _value(registry, decisions, policy="default", outcome="saturated") == 1
    assert _value(registry, "modeldock_picker_pick_seconds_count") == 1
    assert _value(registry, "modeldock_picker_in_flight", endpoint=a.address) == 1
    assert _value(registry, "modeldock_picker_in_flight", endpoint=b.address) == 0
    assert _value(registry, "modeldock_picker_sample_age_seconds", endpoint=a.address) == 0.0
    assert _value(registry, "modeldock_picker_scrape_failures", endpoint=b.address) == 0  # reset by a sample
    score = _value(registry, "modeldock_picker_score", endpoint=a.address)
    assert score is not None and 0.0 < score < 1.0
    clock.advance(1.5)
    assert _value(registry, "modeldock_picker_sample_age_seconds", endpoint=a.address) == 1.5
    lease.release()
    picker.set_endpoints("m", [b])
    assert _value(registry, "modeldock_picker_in_flight", endpoint=a.address) is None  # gone with the endpoint
    assert b"modeldock_picker_score" in generate_latest(registry)


def test_pickers_use_their_own_registries(clock: FakeClock) -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    Picker(clock, registry=first)
    Picker(clock, registry=second, policy="round_robin")  # no clash with the first, nor the global one
    before = {name for c in list(REGISTRY._collector_to_names) for name in REGISTRY._collector_to_names[c]}
    bare = Picker(clock)  # no registry: no metrics at all
    after = {name for c in list(REGISTRY._collector_to_names) for name in REGISTRY._collector_to_names[c]}
    assert after == before and not any(name.startswith("modeldock_picker") for name in after)
    assert not bare._metrics.enabled
    bare.set_endpoints("m", endpoints(1))
    bare.pick("m")  # counting into nothing works, and still registers nothing
    assert b"modeldock_picker" not in generate_latest(REGISTRY)
    for registry in (first, second):  # each picker's metrics went to its own registry only
        assert registry.get_sample_value("modeldock_picker_decisions_total",
                                         {"policy": "round_robin" if registry is second else "default",
                                          "outcome": "picked"}) == 0


def test_round_robin_exports_no_score(clock: FakeClock) -> None:
    registry = CollectorRegistry()
    picker = Picker(clock, registry=registry, policy="round_robin")
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    picker.observe(a, Sample(1, 1, 0.1), clock.monotonic())
    assert _value(registry, "modeldock_picker_score", endpoint=a.address) is None
    assert _value(registry, "modeldock_picker_in_flight", endpoint=a.address) == 0


def test_pick_is_fast_for_eight_endpoints(clock: FakeClock) -> None:
    picker = Picker(clock, registry=CollectorRegistry(), rng=random.Random(3))
    eps = endpoints(8)
    picker.set_endpoints("m", eps)
    for i, ep in enumerate(eps):
        observe(picker, clock, ep, waiting=i % 3, running=10 + i, kv=0.1 * (i % 5))
    timings = []
    for _ in range(2000):
        start = time.perf_counter()
        pick = picker.pick("m")
        timings.append(time.perf_counter() - start)
        pick.lease.release()
    # ~15 µs on a laptop; the bound leaves room for slow, shared CI machines.
    assert statistics.median(timings) < 200e-6
