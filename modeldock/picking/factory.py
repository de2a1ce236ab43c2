"""The picker the config describes: `routing` -> `Picker`, the one place the two meet."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry

from modeldock.clock import Clock
from modeldock.picking.config import RoutingConfig
from modeldock.picking.picker import Picker
from modeldock.picking.saturation import Saturation


def build_picker(routing: RoutingConfig, clock: Clock, registry: CollectorRegistry | None, *,
                 rng: random.Random | None = None) -> Picker:
    sat = routing.saturation
    return Picker(
        clock,
        fallbacks=routing.fallbacks,
        policy=routing.policy,
        weights=routing.weights,  # every scorer's, prefix included, defaults filled in
        stale_after=routing.stale_after_seconds,
        stale_penalty=routing.stale_penalty,
        p2c_threshold=routing.p2c_threshold,
        saturation=Saturation(sat.max_waiting, sat.max_kv, sat.reject, sat.retry_after_seconds, room=sat.room,
                              kv_full=sat.kv_full, stale_max_in_flight=sat.stale_max_in_flight),
        rng=rng,
        registry=registry,
    )
