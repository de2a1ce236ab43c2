"""An injectable clock, so windows and staleness are tested without sleeping."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a monotonic scale; only differences mean anything."""

    def time(self) -> float:
        """Wall-clock seconds since the epoch."""


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._mono = start
        self._offset = wall - start

    def monotonic(self) -> float:
        return self._mono

    def time(self) -> float:
        return self._mono + self._offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._mono += seconds
