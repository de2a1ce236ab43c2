"""Settling a request's tokens once, against what Envoy's access log says it used.

Two events end a request that needs usage (a token budget applies, or usage records are on),
in either order: the ext_proc stream ends (`ended`), and Envoy's per-request gRPC access log
entry arrives with the backend's `usage` (`reported`, parsed by extproc/attempts.py). The entry
usually comes 1-20 ms after the stream end. `PendingSettlements` joins them on the gateway's
request key (`modeldock:rid`) and settles each request exactly once:

- both arrived: settle with the report;
- the stream ended and no report came within `grace` seconds: settle without one (the
  reservation is charged: whether it reached a backend is unknown);
- a report for a key this replica does not hold (another replica's request, a duplicate
  after settlement) is ignored.

Plain Python on an injected clock; `expire()` is what the background sweep calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from modeldock.budgets.tokens import Usage
from modeldock.clock import Clock

log = logging.getLogger("modeldock.extproc")

GRACE_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class UsageReport:
    """What Envoy's access log entry says about one request (the Envoy facts: docs/envoy.md).

    `sent` is what the settlement rule needs (admission/tokens.py `charge_for`): a request whose body
    reached a backend may have been generated for, even when no response header ever came back (vLLM
    sends a non-streaming response's headers only after generation). `timed_out`, `upstream_failed`,
    `backend_error`, `cancelled` and `response_bytes` name how the request ended, for its record.
    """

    rid: str  # the gateway's key for the request (modeldock:rid)
    usage: Usage | None  # the backend's `usage`, None when none was seen (no usage chunk, cut stream)
    reached_backend: bool  # a backend sent response headers (upstream_header_bytes_received > 0)
    status: int = 0  # the status the client got; 0 if none was sent
    cancelled: bool = False  # the client went away before the response ended (flag DC)
    endpoint: str = ""  # ip:port of the last upstream attempt
    attempts: int = 0  # upstream attempts (1 = not retried); 0 if unknown
    # Some attempt wrote the request to a backend's connection (upstream_wire_bytes_sent > 0, summed over
    # attempts). True whenever reached_backend is: a backend that answered had the body.
    sent: bool = False
    timed_out: bool = False  # Envoy's timeouts: route/per-try (UT), stream idle (SI), max duration (DT, UMSDR)
    # Envoy could not get a whole response from any backend: reset (UR, UC, UPE: also after the response
    # started, a cut stream), connect failure (UF), overflow (UO), no healthy upstream (UH), no cluster (NC).
    upstream_failed: bool = False
    # The backend itself answered a complete response with status >= 400 (a retried 503 included).
    backend_error: bool = False
    response_bytes: int = 0  # response body bytes sent to the client (what was streamed before a cut)

    def __post_init__(self) -> None:
        if self.reached_backend and not self.sent:
            object.__setattr__(self, "sent", True)


T = TypeVar("T")


class PendingSettlements(Generic[T]):
    """The join of stream ends and access-log reports, keyed by the gateway's request key.

    `settle(item, report_or_None)` is called exactly once per `ended` item. `is_live(rid)` says
    whether this replica holds an open stream for the key: a report for one is kept until its
    stream ends (`_early`); any other report is not ours.
    """

    def __init__(self, clock: Clock, settle: Callable[[T, UsageReport | None], None],
                 is_live: Callable[[str], bool], *, grace: float = GRACE_SECONDS, sweep: bool = True) -> None:
        self._clock = clock
        self._settle = settle
        self._is_live = is_live
        self.grace = grace
        self._sweep_enabled = sweep
        self._pending: dict[str, tuple[float, T]] = {}  # rid -> (deadline, item), stream ended
        self._early: dict[str, UsageReport] = {}  # rid -> report that came before its stream ended
        self._sweeper: asyncio.Task[None] | None = None
        self.timed_out = 0  # settled without a report

    def __len__(self) -> int:
        return len(self._pending) + len(self._early)

    def ended(self, rid: str, item: T) -> None:
        """The request's stream ended; settle now if its report is here, else wait for it."""
        report = self._early.pop(rid, None) if self._early else None
        if report is not None:
            self._call(item, report)
            return
        if rid in self._pending:
            return  # ended twice: the first one stands
        self._pending[rid] = (self._clock.monotonic() + self.grace, item)
        self._start_sweep()

    def forget(self, rid: str) -> None:
        """A stream that needs no settlement ended: drop a report kept for it (there should be none)."""
        if self._early:
            self._early.pop(rid, None)

    def reported(self, report: UsageReport) -> None:
        """Envoy's entry for a request arrived (every replica hears every entry)."""
        found = self._pending.pop(report.rid, None)
        if found is not None:
            self._call(found[1], report)
        elif report.rid not in self._early and self._is_live(report.rid):
            self._early[report.rid] = report

    def expire(self) -> int:
        """Settle, without a report, every request whose grace ran out. Returns how many."""
        if not self._pending:
            return 0
        now = self._clock.monotonic()
        due = [rid for rid, (deadline, _) in self._pending.items() if deadline <= now]
        for rid in due:
            _, item = self._pending.pop(rid)
            self.timed_out += 1
            self._call(item, None)
        return len(due)

    def flush(self) -> int:
        """At shutdown: settle everything still waiting, without a report."""
        count = len(self._pending)
        for _, item in list(self._pending.values()):
            self._call(item, None)
        self._pending.clear()
        self._early.clear()
        return count

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None

    def _call(self, item: T, report: UsageReport | None) -> None:
        try:
            self._settle(item, report)
        except Exception:
            # A settlement bug must not take the access-log stream (or the sweep) down with it.
            log.exception("settling a request's usage failed")

    def _start_sweep(self) -> None:
        if not self._sweep_enabled or (self._sweeper is not None and not self._sweeper.done()):
            return
        try:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="settlement-sweep")
        except RuntimeError:
            pass  # no loop (a synchronous test): the caller drives expire()

    async def _sweep(self) -> None:
        # Wakes a few times per grace period while anything is pending, then stops.
        while self._pending:
            await asyncio.sleep(self.grace / 4)
            self.expire()
