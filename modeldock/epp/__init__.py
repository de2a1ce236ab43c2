"""Picker mode: modeldock's ext_proc as the Endpoint Picker of a Gateway API gateway's InferencePool."""

from modeldock.epp.flow import PickerFlow, PickerOptions
from modeldock.epp.server import PickerServicer

__all__ = ["PickerFlow", "PickerOptions", "PickerServicer"]
