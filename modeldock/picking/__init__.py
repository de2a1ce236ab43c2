"""Picking: which endpoint serves a request, and the in-flight ledger behind it."""

from modeldock.picking.picker import Lease, Pick, Picker

__all__ = ["Lease", "Pick", "Picker"]
