"""An exact sliding-window log kept in this process.

A request at time `now` is admitted for a key when fewer than `limit` requests
were admitted for that key in the half-open interval (now - window, now]. So no
interval of `window` seconds ever holds more than `limit` admissions, and a slot
comes back exactly `window` seconds after the admission that used it.

Memory: one deque per key holding at most `limit` timestamps; keys whose
newest entry has left the window are dropped by a sweep that runs at most once
per window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from modeldock.clock import Clock

WINDOW_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome for one limit.

    remaining: slots left after this request (0 when rejected).
    reset_after_s: seconds until the window is empty again, i.e. remaining == limit.
    retry_after_s: seconds until a slot frees; 0 when admitted.
    at: the window clock's time of the decision (used to undo an admission).
    """

    allowed: bool
    limit: int
    remaining: int
    reset_after_s: float
    retry_after_s: float
    at: float = 0.0


def binding(decisions: Sequence[Decision]) -> int:
    """Index of the decision to report when several limits apply to one request.

    A rejection that takes longest to clear wins; otherwise the limit with the
    fewest slots left (then the longest reset).
    """
    if not decisions:
        raise ValueError("no decisions")
    rejected = [i for i, d in enumerate(decisions) if not d.allowed]
    if rejected:
        return max(rejected, key=lambda i: decisions[i].retry_after_s)
    return min(range(len(decisions)), key=lambda i: (decisions[i].remaining, -decisions[i].reset_after_s))


class SlidingWindow:
    def __init__(self, clock: Clock, window_seconds: float = WINDOW_SECONDS) -> None:
        if window_seconds <= 0:
            raise ValueError("window_seconds must be positive")
        self._clock = clock
        self.window_seconds = window_seconds
        self._log: dict[str, deque[float]] = {}
        self._last_sweep = clock.monotonic()

    def try_acquire(self, key: str, limit: int) -> Decision:
        return self.try_acquire_all([(key, limit)])[0]

    def try_acquire_all(self, limits: Sequence[tuple[str, int]]) -> list[Decision]:
        """Admit into every key only if every key has room (all or nothing)."""
        now = self._clock.monotonic()
        self._maybe_sweep(now)
        logs = [self._pruned(key, now) for key, _ in limits]
        allowed = all(len(log) < limit for log, (_, limit) in zip(logs, limits, strict=True))
        decisions = []
        for found, (key, limit) in zip(logs, limits, strict=True):
            log = found
            if allowed:
                if log is _EMPTY:
                    log = self._log[key] = deque()
                log.append(now)
            decisions.append(self._decision(log, limit, allowed, now))
        return decisions

    def undo(self, key: str, at: float) -> None:
        """Give back one slot admitted at `at` (e.g. when Redis then said no)."""
        log = self._log.get(key)
        if not log:
            return
        # Entries with equal timestamps are interchangeable; the newest match is near the right end.
        for i in range(len(log) - 1, -1, -1):
            if log[i] == at:
                del log[i]
                break
        if not log:
            del self._log[key]

    def count(self, key: str) -> int:
        """Admissions for `key` still inside the window."""
        return len(self._pruned(key, self._clock.monotonic()))

    def __len__(self) -> int:
        """Keys currently held (for tests and memory checks)."""
        return len(self._log)

    def _pruned(self, key: str, now: float) -> deque[float]:
        log = self._log.get(key)
        if log is None:
            return _EMPTY
        # `now - ts >= window` is the one expiry test used everywhere, so float
        # rounding cannot make two code paths disagree about an entry.
        while log and now - log[0] >= self.window_seconds:
            log.popleft()
        return log

    def _decision(self, log: deque[float], limit: int, allowed: bool, now: float) -> Decision:
        count = len(log)
        reset = self._left(log[-1], now) if log else 0.0
        retry = 0.0
        if not allowed and count >= limit:
            # The slot frees when enough old entries expire to bring the count below the limit.
            retry = self._left(log[count - limit], now) if limit > 0 else self.window_seconds
        return Decision(
            allowed=allowed,
            limit=limit,
            remaining=max(limit - count, 0),
            reset_after_s=reset,
            retry_after_s=retry,
            at=now,
        )

    def _left(self, admitted_at: float, now: float) -> float:
        """Seconds until an entry expires; written as window - age so a fresh entry gives exactly the window."""
        return min(max(self.window_seconds - (now - admitted_at), 0.0), self.window_seconds)

    def _maybe_sweep(self, now: float) -> None:
        if now - self._last_sweep < self.window_seconds:
            return
        self._last_sweep = now
        idle = [key for key, log in self._log.items() if not log or now - log[-1] >= self.window_seconds]
        for key in idle:
            del self._log[key]


# Shared stand-in for a key with no log yet, so a rejected lookup allocates nothing.
_EMPTY: deque[float] = deque(maxlen=0)
