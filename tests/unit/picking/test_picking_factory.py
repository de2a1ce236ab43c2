"""The picker built from a Config gets every routing value the config gives."""

from __future__ import annotations

import random

import pytest
from picking_helpers import endpoints, observe

from modeldock.clock import FakeClock
from modeldock.config import ConfigError, parse_config
from modeldock.errors import Unavailable
from modeldock.picking.factory import build_picker
from modeldock.picking.registry import DEFAULT_WEIGHTS


def _config(routing: dict[str, object]) -> dict[str, object]:
    return {"models": [{"name": "m", "endpoints": ["10.0.0.1:8000"]}], "routing": routing}


@pytest.mark.parametrize(("stale_after", "p2c", "fallbacks"), [(2.0, 32, 2), (7.5, 5, 0), (0.5, 2, 4)])
def test_routing_values_arrive(stale_after: float, p2c: int, fallbacks: int) -> None:
    config = parse_config(_config({
        "stale_after_seconds": stale_after, "p2c_threshold": p2c, "fallbacks": fallbacks, "stale_penalty": 0.3,
        "weights": {"queue": 0.5, "kv": 0.5, "running": 0, "in_flight": 0, "prefix": 0.1, "kv_headroom": 0,
                    "predicted_wait": 0},
        "saturation": {"max_waiting": 7, "reject": "unavailable", "retry_after_seconds": 3},
    }))
    clock = FakeClock()
    picker = build_picker(config.routing, clock, None, rng=random.Random(1))
    assert picker.fallbacks == fallbacks and picker.policy == "default"
    settings = picker.settings
    assert settings.stale_after == stale_after
    assert settings.p2c_threshold == p2c
    assert settings.weights == {"queue": 0.5, "kv": 0.5, "prefix": 0.1}
    assert settings.stale_penalty == 0.3
    sat = settings.saturation
    assert sat is not None and (sat.max_waiting, sat.max_kv, sat.reject, sat.retry_after_seconds) == (
        7, None, "unavailable", 3)

    # The same values, seen from outside: freshness, fallbacks, saturation.
    eps = endpoints(6)
    picker.set_endpoints("m", eps)
    observe(picker, clock, eps[0])
    clock.advance(stale_after * 0.99)
    assert picker.signals(eps[0]).fresh
    clock.advance(stale_after * 0.02)
    assert not picker.signals(eps[0]).fresh
    pick = picker.pick("m")
    assert len(pick.fallbacks) == min(fallbacks, len(eps) - 1)
    pick.lease.release()
    for ep in eps:
        observe(picker, clock, ep, waiting=7)
    with pytest.raises(Unavailable) as caught:
        picker.pick("m")
    assert caught.value.headers == {"Retry-After": "3"}


def test_default_weights_arrive_and_prefix_is_on() -> None:
    picker = build_picker(parse_config(_config({})).routing, FakeClock(), None)
    total = sum(w for name, w in DEFAULT_WEIGHTS.items() if name != "prefix")
    want = {name: (w if name == "prefix" else w / total) for name, w in DEFAULT_WEIGHTS.items() if w > 0}
    assert picker.settings.weights == pytest.approx(want)
    assert picker.request_scorer("prefix") is not None
    assert picker.settings.near_tie == 0.06 and picker.settings.request_scorers == ("prefix",)


def test_prefix_zero_turns_affinity_off_and_other_policies_have_none() -> None:
    off = build_picker(parse_config(_config({"weights": {"prefix": 0}})).routing, FakeClock(), None)
    assert off.request_scorer("prefix") is None
    least = build_picker(parse_config(_config({"policy": "least_request"})).routing, FakeClock(), None)
    assert least.policy == "least_request" and least.settings.weights == {} and least.settings.near_tie is None


@pytest.mark.parametrize(("weights", "reason"), [({"latency": 1}, "unknown scorer"), ({"kv": -1}, ">= 0"),
                                                  ({"queue": 0, "kv": 0, "running": 0, "in_flight": 0, "kv_headroom": 0,
                                                    "predicted_wait": 0}, "load scorer")])
def test_bad_weights_are_config_errors_naming_the_field(weights: dict[str, float], reason: str) -> None:
    with pytest.raises(ConfigError, match=rf"routing\.weights: .*{reason}"):
        parse_config(_config({"weights": weights}))


def test_the_picker_is_a_facade_over_private_halves() -> None:
    picker = build_picker(parse_config(_config({})).routing, FakeClock(), None)
    assert not hasattr(picker, "ledger") and not hasattr(picker, "scheduler")
    assert picker.settings.policy == picker.policy == "default" and picker.settings.fallbacks == picker.fallbacks
