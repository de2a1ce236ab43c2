"""`UsageLog`: what the request path calls once per answered request (the settle step).

    usage = UsageLog.open(config.usage, clock, registry)   # at start; raises UsageSinkError
    usage.emit(UsageRecord(...))                          # per request, on the event loop
    usage.close()                                         # at shutdown, after draining

`emit` never raises: a record that cannot be written is counted
(`modeldock_usage_write_errors_total`) and logged at most once a minute, and the request
goes on. Tokens are counted in `modeldock_tokens_total` either way.
"""

from __future__ import annotations

import dataclasses
import logging

from prometheus_client import CollectorRegistry

from modeldock.clock import Clock
from modeldock.usage.config import UsageConfig
from modeldock.usage.metrics import UsageMetrics
from modeldock.usage.record import UsageRecord
from modeldock.usage.writer import FileSink, Sink, StdoutSink

log = logging.getLogger(__name__)
ERROR_LOG_INTERVAL = 60.0


class UsageLog:
    def __init__(self, sink: Sink | None, metrics: UsageMetrics, clock: Clock, replica: str = "") -> None:
        self.sink = sink
        self.metrics = metrics
        self.replica = replica
        self._clock = clock
        self._last_error_log: float | None = None
        self.lost = 0

    @classmethod
    def open(cls, config: UsageConfig | None, clock: Clock, registry: CollectorRegistry | None = None,
             *, background: bool = True) -> UsageLog:
        """The log `config` asks for; with no config (or enabled: false), metrics only, no records."""
        if config is None or not config.enabled:
            return cls(None, UsageMetrics(registry), clock)
        sink: Sink = StdoutSink() if config.stdout else FileSink(config, clock, background=background)
        return cls(sink, UsageMetrics(registry, config.max_label_sets), clock, config.replica_id())

    def emit(self, record: UsageRecord) -> None:
        self.metrics.observe(record)
        if self.sink is None:
            return
        if not record.replica and self.replica:
            record = dataclasses.replace(record, replica=self.replica)
        try:
            self.sink.write((record.to_json() + "\n").encode())
        except OSError as exc:
            self.lost += 1
            self.metrics.write_error()
            now = self._clock.monotonic()
            if self._last_error_log is None or now - self._last_error_log >= ERROR_LOG_INTERVAL:
                self._last_error_log = now
                log.error("usage: record %s lost, cannot write: %s (%d lost so far)", record.request_id, exc, self.lost)
            return
        self.metrics.written()

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
