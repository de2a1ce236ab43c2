"""Picking: which endpoint serves a request, and the in-flight ledger behind it.

The names below are loaded on first use (PEP 562), so importing `modeldock.picking.config`
(the `routing:` section the ground-floor schema mounts) loads nothing else of picking.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modeldock.picking.parse import parse_metrics
    from modeldock.picking.picker import Lease, Pick, Picker
    from modeldock.picking.policies import POLICY_NAMES
    from modeldock.picking.saturation import Saturated, Saturation
    from modeldock.picking.scrape import Scraper
    from modeldock.picking.signals import Sample, Signals

_HOMES = {
    "parse_metrics": "parse", "Lease": "picker", "Pick": "picker", "Picker": "picker", "POLICY_NAMES": "policies",
    "Saturated": "saturation", "Saturation": "saturation", "Scraper": "scrape", "Sample": "signals",
    "Signals": "signals",
}

__all__ = [
    "POLICY_NAMES", "Lease", "Pick", "Picker", "Sample", "Saturated", "Saturation", "Scraper", "Signals",
    "parse_metrics",
]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once: later lookups do not come here
    return value
