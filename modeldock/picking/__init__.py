"""Picking: which endpoint serves a request, and the in-flight ledger behind it."""

from modeldock.picking.parse import parse_metrics
from modeldock.picking.picker import Lease, Pick, Picker
from modeldock.picking.policies import POLICY_NAMES
from modeldock.picking.saturation import Saturated, Saturation
from modeldock.picking.scrape import Scraper
from modeldock.picking.signals import Sample, Signals

__all__ = [
    "POLICY_NAMES", "Lease", "Pick", "Picker", "Sample", "Saturated", "Saturation", "Scraper", "Signals",
    "parse_metrics",
]
