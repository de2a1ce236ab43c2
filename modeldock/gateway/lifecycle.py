"""One owner of a request's life: the key it gets, where it is served, how it ended, its settlement.

`Lifecycle` is the gateway-level registry both protocol adapters (extproc/, epp/) and the access-log
servicer talk to, in plain Python (no gRPC). It mints the request key (`modeldock:rid`: a random
per-process prefix and a counter, unique across replicas and restarts, never the client's
`x-request-id`), holds the open routed requests by that key (for Envoy's retry reports) and the
pending settlements (`PendingSettlements`), and calls `Gateway.settle`, the one settlement entry.

A request's states (`Stage`): OPEN (its stream is open), RETRIED (open, and moved off its primary),
ENDED (its stream ended; settled now, or when its usage report comes, or after `grace`), REPORTED
(Envoy's usage report came while its stream was still open; settled at its end).

`Outcome` is the record both adapters' flows share (each flow is one): the key, the head, the
`Routed` result, where it was served, and the outcome, status, tenant and model for metrics.

`Hooks` is what the registry tells the process (metrics), in go-control-plane's `Callbacks` style:
one protocol, a no-op default (`NoHooks`), called by the registry only.
"""

from __future__ import annotations

import itertools
import secrets
from enum import Enum
from typing import Protocol

from modeldock.errors import Rejection
from modeldock.gateway.director import Gateway
from modeldock.gateway.request import RequestHead
from modeldock.gateway.routed import Finished, Routed
from modeldock.gateway.settlement import GRACE_SECONDS, PendingSettlements, UsageReport


class Stage(Enum):
    OPEN = 1
    RETRIED = 2
    ENDED = 3
    REPORTED = 4


class Outcome:
    """How one request went, as either adapter records it (its flow is one)."""

    def __init__(self, rid: str = "") -> None:
        # The gateway's key (modeldock:rid); Envoy's reports are joined on it. The client's
        # x-request-id (head.request_id) is only for log correlation.
        self.rid = rid
        self.stage = Stage.OPEN
        self.started = 0.0  # the gateway clock's monotonic() when the registry opened it (request duration)
        self.head: RequestHead | None = None
        self.routed: Routed | None = None
        self.served_by = ""  # set when a retry moved the request onto another endpoint
        self.outcome = "incomplete"
        self.status = 0
        # Metric labels: the configured tenant id and model name once known, else "" (never client text).
        self.tenant_id = ""
        self.model_name = ""

    def proxied(self, routed: Routed) -> None:
        self.routed = routed
        self.outcome = "proxied"
        self.tenant_id, self.model_name = routed.tenant.id, routed.model

    def rejected(self, rejection: Rejection) -> None:
        self.outcome, self.status = "rejected", rejection.status
        self.tenant_id, self.model_name = rejection.tenant, rejection.model

    def listed_models(self, tenant_id: str) -> None:
        self.outcome, self.status = "models", 200
        self.tenant_id = tenant_id

    @property
    def primary(self) -> str:
        return self.routed.destination.primary.address if self.routed is not None else ""

    @property
    def retried(self) -> bool:
        """Moved off the primary before the first byte."""
        return bool(self.served_by) and self.served_by != self.primary

    def moved_to(self, address: str) -> bool:
        """Count the request on `address` ("ip:port"), where a retry moved it. False when nothing moved
        (not routed, not an endpoint, or counted there already). The caller checks the stream is open."""
        routed = self.routed
        if routed is None or not routed.holdings.lease.move_to(address):
            return False
        self.served_by = routed.holdings.lease.endpoint.address
        if self.stage is Stage.OPEN:
            self.stage = Stage.RETRIED
        return True

    def finished(self) -> Finished | None:
        """What settling the routed request needs; None when not routed."""
        routed = self.routed
        if routed is None:
            return None
        client_id = self.head.request_id if self.head is not None else ""
        return Finished(routed, self.rid, client_id, 1 if self.retried else 0)


class Hooks(Protocol):
    """What the registry reports, each at most once per event (metrics implement it)."""

    def on_retried(self, request: Outcome) -> None:
        """A retry moved the request onto another endpoint (Envoy's report, or the gateway's served header)."""

    def on_finished(self, request: Outcome, seconds: float) -> None:
        """The request's stream ended, however it ended; `seconds` since it opened."""

    def on_reported(self, report: UsageReport) -> None:
        """Envoy's usage log entry for some request was heard (every replica hears all)."""


class NoHooks:
    """The default: nothing is told. Subclass it to implement only some hooks."""

    def on_retried(self, request: Outcome) -> None:
        pass

    def on_finished(self, request: Outcome, seconds: float) -> None:
        pass

    def on_reported(self, report: UsageReport) -> None:
        pass


NO_HOOKS = NoHooks()


class Lifecycle:
    """The registry of this replica's requests, from the key to the settlement.

    `await_reports`: routed requests that need usage are settled when Envoy's usage log reports them
    (modeldock's own bootstrap); False: each routed request is settled at its stream end with what its
    adapter read (picker mode: a gateway modeldock did not configure sends no usage log).
    """

    def __init__(self, gateway: Gateway, hooks: Hooks = NO_HOOKS, *, await_reports: bool = True,
                 grace: float = GRACE_SECONDS, sweep: bool = True) -> None:
        self._settle = gateway.settle
        self._clock = gateway.clock
        self.hooks = hooks
        self.await_reports = await_reports
        self._prefix = secrets.token_hex(6) + "-"
        self._counter = itertools.count(1)
        # Routed requests whose stream is open, by key: Envoy's retry and usage reports find them here.
        self._open: dict[str, Outcome] = {}
        self.settlements: PendingSettlements[Finished] = PendingSettlements(
            gateway.clock, gateway.settle, self._open.__contains__, grace=grace, sweep=sweep)

    def key(self) -> str:
        return f"{self._prefix}{next(self._counter)}"

    def open(self, request: Outcome) -> Outcome:
        """A stream opened: give its record a key and its start."""
        request.rid = self.key()
        request.started = self._clock.monotonic()
        return request

    def routed(self, request: Outcome) -> None:
        """The request was routed: before Envoy has the answer, so that no report for it can come first."""
        self._open[request.rid] = request

    def moved(self, request: Outcome, address: str) -> bool:
        """The request was served on `address` (a retry): count it there; True when it moved."""
        if not request.moved_to(address):
            return False
        self.hooks.on_retried(request)
        return True

    def retried(self, rid: str, address: str) -> None:
        """Envoy retried the request keyed `rid` on `address`; ignored unless it is open here."""
        request = self._open.get(rid)
        if request is not None:
            self.moved(request, address)

    def reported(self, report: UsageReport) -> None:
        """Envoy's usage log entry for a request; acted on only by the replica holding it."""
        if not self.await_reports:
            return
        self.hooks.on_reported(report)
        request = self._open.get(report.rid) if self._open else None
        if request is not None:
            request.stage = Stage.REPORTED
        self.settlements.reported(report)

    def ended(self, request: Outcome, report: UsageReport | None = None) -> None:
        """The request's stream ended (its flow released what it held): settle it, now or when its report
        comes. `report`: what the adapter read itself (picker mode). Call once per stream."""
        opened = self._open.pop(request.rid, None) is not None
        request.stage = Stage.ENDED
        if not self.await_reports:
            finished = request.finished()
            if finished is not None:
                self._settle(finished, report)  # errors propagate, as the picker flow's always did
        elif opened:
            finished = request.finished()
            if finished is not None and finished.routed.usage.wants_usage:
                self.settlements.ended(request.rid, finished)
            else:
                self.settlements.forget(request.rid)
        self.hooks.on_finished(request, self._clock.monotonic() - request.started)

    def opened(self) -> int:
        """Routed requests whose stream is still open here."""
        return len(self._open)

    def pending(self) -> int:
        """Ended requests waiting for their usage report (not __len__: an empty registry is still one)."""
        return len(self.settlements)
