"""Per-request usage records (JSON lines), their writer, token counters and the summary command.

The names below are loaded on first use (PEP 562), so importing `modeldock.usage.config` (the `usage:`
section the config schema mounts) loads nothing else of usage, and no prometheus_client.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modeldock.usage.config import UsageConfig
    from modeldock.usage.log import UsageLog
    from modeldock.usage.metrics import UsageMetrics
    from modeldock.usage.record import (
        FORMAT_VERSION,
        TERMINATIONS,
        RecordError,
        Termination,
        UsageRecord,
        new_request_id,
    )
    from modeldock.usage.writer import FileSink, StdoutSink, UsageSinkError

# Each name's module; the TYPE_CHECKING imports above say the same for mypy and the import-graph test.
_HOMES = {
    "UsageConfig": "config", "UsageLog": "log", "UsageMetrics": "metrics", "FORMAT_VERSION": "record",
    "TERMINATIONS": "record", "RecordError": "record", "Termination": "record", "UsageRecord": "record",
    "new_request_id": "record", "FileSink": "writer", "StdoutSink": "writer", "UsageSinkError": "writer",
}

__all__ = [
    "FORMAT_VERSION", "TERMINATIONS", "FileSink", "RecordError", "StdoutSink", "Termination", "UsageConfig",
    "UsageLog", "UsageMetrics", "UsageRecord", "UsageSinkError", "new_request_id",
]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once: later lookups do not come here
    return value
