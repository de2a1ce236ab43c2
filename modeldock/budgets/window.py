"""An exact sliding window of token amounts, kept in this process.

The weighted twin of `window.SlidingWindow`: each entry is one reservation
(id, time, amount). A reservation of `cost` at time `now` fits a key when the
amounts of the entries in (now - window, now] plus `cost` are at most the
limit. Settling changes an entry's amount in place and keeps its time, so an
entry counts for exactly one window after it was reserved, with whatever
amount it holds by then. An entry that has already left the window cannot be
settled any more (there is nothing left to adjust).

Every key has its own window length (60 s for per-minute budgets), passed with the key. A negative
length marks a calendar period's counter (period.py): its key names the period, so nothing
expires by time; a settled entry is folded into the total (only held entries are kept), and the key is
dropped once idle for -length seconds.

Amounts can depend on the grant: `try_reserve_up_to` admits when the least grant fits every key and
adds the largest grant up to `want` that fits all, each key counting its `Shape` of it (a token window
counts prompt + output; a cost window the price of that, in millionths).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from modeldock.admission.window import Decision
from modeldock.clock import Clock


@dataclass(slots=True)
class _Entry:
    id: str
    at: float
    amount: int


@dataclass(slots=True)
class _Log:
    entries: deque[_Entry] = field(default_factory=deque)
    by_id: dict[str, _Entry] = field(default_factory=dict)
    total: int = 0
    last: float = 0.0  # when it was last reserved in (counters are dropped once idle)
    keep: float = 0.0  # counters: how long they outlive their last reservation


# (key, limit, window seconds; negative: a period's counter)
BudgetLimit = tuple[str, int, float]
# A key's amount for a grant x: ceil(base + slope * x). (0, 1): the grant itself.
Shape = tuple[float, float]
UNIT: Shape = (0, 1.0)  # an int base: token amounts stay exact integers
_EPS = 1e-9


def shaped(shape: Shape, grant: int) -> int:
    """What a key counts for `grant` (whole units, rounded up: a budget never under-counts)."""
    base, slope = shape
    if slope == 1.0 and type(base) is int:  # tokens: the fast path, exact
        return base + grant
    return max(math.ceil(base + slope * grant - _EPS), 0)


def most_that_fits(shape: Shape, room: int, want: int) -> int:
    """The largest grant <= `want` whose amount fits `room` (may be below any minimum: the caller checks)."""
    base, slope = shape
    if slope == 1.0 and type(base) is int:
        return min(room - base, want)
    if slope <= 0.0:
        return want if shaped(shape, 0) <= room else -1
    most = math.floor((room - base + _EPS) / slope)
    while most >= 0 and shaped(shape, most) > room:  # float rounding: never over
        most -= 1
    return min(most, want)


class TokenWindow:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._logs: dict[str, _Log] = {}
        self._last_sweep = clock.monotonic()
        self._longest = 0.0

    def try_reserve_all(self, entry_id: str, cost: int, limits: Sequence[BudgetLimit]) -> list[Decision]:
        """Add `cost` under `entry_id` to every key only if every key has room (all or nothing).

        An id already held by the first key is not added again (the same request
        reserving twice): the decisions then report it as admitted.
        """
        return self.try_reserve_up_to(entry_id, cost, cost, limits)[0]

    def try_reserve_up_to(
        self, entry_id: str, least: int, want: int, limits: Sequence[BudgetLimit],
        shapes: Sequence[Shape] | None = None,
    ) -> tuple[list[Decision], int]:
        """Admit when the grant `least` fits every key; then add the largest grant g <= `want` that fits
        all (each key counts `shaped(its shape, g)`). The decisions and g (0 when refused)."""
        now = self._clock.monotonic()
        self._maybe_sweep(now)
        forms = shapes if shapes is not None else [UNIT] * len(limits)
        logs = [self._pruned(key, window, now) for key, _, window in limits]
        if logs and logs[0] is not None and entry_id in logs[0].by_id:
            return [
                self._decision(log, limit, window, 0, True, now)
                for log, (_, limit, window) in zip(logs, limits, strict=True)
            ], least
        grant = max(want, least)
        if shapes is None:  # one amount for every key (the request path's token budgets)
            for log, (_, limit, _w) in zip(logs, limits, strict=True):
                room = limit - (log.total if log else 0)
                if room < grant:
                    grant = room
        else:
            for log, (_, limit, _w), shape in zip(logs, limits, forms, strict=True):
                grant = min(grant, most_that_fits(shape, limit - (log.total if log else 0), grant))
        allowed = grant >= least
        out = []
        for found, (key, limit, window), shape in zip(logs, limits, forms, strict=True):
            log = found
            amount = (grant if allowed else least) if shapes is None else shaped(shape, grant if allowed else least)
            if allowed:
                if log is None:
                    log = self._logs[key] = _Log(keep=-window)
                entry = _Entry(entry_id, now, amount)
                if window >= 0:
                    log.entries.append(entry)
                    self._longest = max(self._longest, window)
                log.by_id[entry_id] = entry
                log.total += amount
                log.last = now
            out.append(self._decision(log, limit, window, amount, allowed, now))
        return out, grant if allowed else 0

    def settle(
        self, entry_id: str, keys: Sequence[tuple[str, float]], amount: int | Sequence[int], *, final: bool = True
    ) -> int:
        """Set the entry's amount (one for all keys, or one per key) in every key that still holds it; 0
        removes it, and so does a `final` settlement in a counter (its amount stays in the total).
        Returns keys changed."""
        if isinstance(amount, int):
            if amount < 0:
                raise ValueError("amount must be >= 0")
            amounts: Sequence[int] = [amount] * len(keys)
        else:
            amounts = amount
            if any(a < 0 for a in amounts):
                raise ValueError("amount must be >= 0")
        now = self._clock.monotonic()
        changed = 0
        for (key, window), value in zip(keys, amounts, strict=True):
            log = self._pruned(key, window, now)
            entry = log.by_id.get(entry_id) if log else None
            if log is None or entry is None:
                continue
            log.total += value - entry.amount
            entry.amount = value
            if value == 0 or (final and window < 0):
                # Stays in the deque with amount 0 until it expires; removing from the middle is O(n).
                del log.by_id[entry_id]
            changed += 1
        return changed

    def used(self, key: str, window: float) -> int:
        """Tokens counted for `key` in the window now."""
        log = self._pruned(key, window, self._clock.monotonic())
        return log.total if log else 0

    def __len__(self) -> int:
        return len(self._logs)

    def _pruned(self, key: str, window: float, now: float) -> _Log | None:
        log = self._logs.get(key)
        if log is None or window < 0:
            return log
        entries = log.entries
        # The same expiry test as window.SlidingWindow: gone once now - at >= window.
        while entries and now - entries[0].at >= window:
            old = entries.popleft()
            if log.by_id.get(old.id) is old:
                del log.by_id[old.id]
            log.total -= old.amount
        return log

    def _decision(self, log: _Log | None, limit: int, window: float, cost: int, allowed: bool, now: float) -> Decision:
        used = log.total if log else 0
        reset = 0.0
        retry = 0.0
        if log and log.entries:
            reset = _left(log.entries[-1].at, now, window)
            if not allowed and used + cost > limit:
                retry = window
                freed = 0
                for entry in log.entries:
                    freed += entry.amount
                    if used - freed + cost <= limit:
                        retry = _left(entry.at, now, window)
                        break
        return Decision(
            allowed=allowed,
            limit=limit,
            remaining=max(limit - used, 0),
            reset_after_s=reset,
            retry_after_s=retry,
            at=now,
        )

    def _idle(self, log: _Log, now: float) -> bool:
        if log.keep > 0:  # a counter: its period is over once nothing reserved in it for `keep`
            return now - log.last >= log.keep and not log.by_id
        return not log.entries or now - log.entries[-1].at >= self._longest

    def _maybe_sweep(self, now: float) -> None:
        every = min(self._longest or math.inf, 3600.0)  # counters are swept hourly at least
        if now - self._last_sweep < every:
            return
        self._last_sweep = now
        idle = [k for k, log in self._logs.items() if self._idle(log, now)]
        for key in idle:
            del self._logs[key]


def _left(at: float, now: float, window: float) -> float:
    return min(max(window - (now - at), 0.0), window)
