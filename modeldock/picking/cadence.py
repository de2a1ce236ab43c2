"""When each endpoint's page is read next: one due time per endpoint, on the injected clock.

An endpoint that was busy when its last read started (this gateway had requests there, or its
model had a queue waiting) is read again `interval` after that start; one with nothing here after
`idle_interval`, so the oldest its sample gets before the next read lands is `idle_interval` plus
one read's timeout (config.py keeps that below the picker's stale cutoff). `hurry` moves an
endpoint onto the busy cadence at once (a pick there: its page is read `interval` after the last
read started, now if that is past); a failed read is retried at the busy cadence. An endpoint's
first idle gap is spread between `interval` and `idle_interval` by its address, so a pool that
starts idle does not read every page in one burst per idle period.

Pure bookkeeping, no I/O and no clock of its own: the Scraper passes `now`.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from modeldock.types import Endpoint


class Cadence:
    """`interval`: the busy cadence; `idle_interval`: the idle one (None, or not above `interval`:
    every endpoint at `interval`, the fixed rounds); `slack`: reads due within this much of a wake
    are taken with it (a little early), so rounds gather endpoints instead of waking per endpoint."""

    def __init__(self, interval: float, idle_interval: float | None = None, *, slack: float | None = None) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0")
        self.interval = interval
        self.idle_interval = max(interval, idle_interval or interval)
        self.slack = interval / 5 if slack is None else slack
        self._next: dict[Endpoint, float] = {}  # when each endpoint is due
        self._last: dict[Endpoint, float] = {}  # when its last scheduled read started

    @property
    def adaptive(self) -> bool:
        return self.idle_interval > self.interval

    def sync(self, endpoints: Iterable[Endpoint], now: float) -> None:
        """Follow the current endpoints: a new one is due now, one gone is forgotten."""
        current = set(endpoints)
        for gone in self._next.keys() - current:
            del self._next[gone]
            self._last.pop(gone, None)
        for ep in current - self._next.keys():
            self._next[ep] = now

    def due(self, now: float) -> list[Endpoint]:
        """The endpoints to read at a wake at `now` (those due within the slack included)."""
        horizon = now + self.slack
        return [ep for ep, at in self._next.items() if at <= horizon]

    def next_due(self) -> float | None:
        return min(self._next.values(), default=None)

    def due_at(self, endpoint: Endpoint) -> float | None:
        return self._next.get(endpoint)

    def last_read(self, endpoint: Endpoint) -> float | None:
        return self._last.get(endpoint)

    def started(self, endpoint: Endpoint, now: float, busy: bool) -> None:
        """A scheduled read of `endpoint` started at `now`; `busy`: this gateway had requests there
        (or its model a queue), so it is read again at the busy cadence."""
        first = endpoint not in self._last
        self._last[endpoint] = now
        gap = self.interval
        if not busy and self.adaptive:
            gap = self.idle_interval
            if first:
                gap = self.interval + (self.idle_interval - self.interval) * _phase(endpoint)
        self._next[endpoint] = now + gap

    def failed(self, endpoint: Endpoint) -> None:
        """Its read failed: try again at the busy cadence (the old sample is ageing)."""
        self.hurry(endpoint)

    def hurry(self, endpoint: Endpoint) -> float | None:
        """Put `endpoint` on the busy cadence from its last read on; its due time now (None: not
        tracked). Never later than it was due."""
        at = self._next.get(endpoint)
        if at is None:
            return None
        last = self._last.get(endpoint)
        if last is not None and last + self.interval < at:
            at = self._next[endpoint] = last + self.interval
        return at


def _phase(endpoint: Endpoint) -> float:
    """A stable fraction in [0, 1) per address (not Python's salted `hash`: runs repeat)."""
    return zlib.crc32(endpoint.address.encode()) / 2**32
