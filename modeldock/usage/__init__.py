"""Per-request usage records (JSON lines), their writer, token counters and the summary command."""

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

__all__ = [
    "FORMAT_VERSION", "TERMINATIONS", "FileSink", "RecordError", "StdoutSink", "Termination", "UsageConfig",
    "UsageLog", "UsageMetrics", "UsageRecord", "UsageSinkError", "new_request_id",
]
