"""An exact sliding window of token amounts, kept in this process.

The weighted twin of `window.SlidingWindow`: each entry is one reservation
(id, time, amount). A reservation of `cost` at time `now` fits a key when the
amounts of the entries in (now - window, now] plus `cost` are at most the
limit. Settling changes an entry's amount in place and keeps its time, so an
entry counts for exactly one window after it was reserved, with whatever
amount it holds by then. An entry that has already left the window cannot be
settled any more (there is nothing left to adjust).

Every key has its own window length (60 s for per-minute budgets, 86400 s for
per-day), passed with the key.
"""

from __future__ import annotations

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


# (key, limit, window seconds)
BudgetLimit = tuple[str, int, float]


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
        now = self._clock.monotonic()
        self._maybe_sweep(now)
        logs = [self._pruned(key, window, now) for key, _, window in limits]
        if logs and logs[0] is not None and entry_id in logs[0].by_id:
            return [
                self._decision(log, limit, window, 0, True, now)
                for log, (_, limit, window) in zip(logs, limits, strict=True)
            ]
        allowed = all(
            (log.total if log else 0) + cost <= limit for log, (_, limit, _w) in zip(logs, limits, strict=True)
        )
        out = []
        for found, (key, limit, window) in zip(logs, limits, strict=True):
            log = found
            if allowed:
                if log is None:
                    log = self._logs[key] = _Log()
                entry = _Entry(entry_id, now, cost)
                log.entries.append(entry)
                log.by_id[entry_id] = entry
                log.total += cost
                self._longest = max(self._longest, window)
            out.append(self._decision(log, limit, window, cost, allowed, now))
        return out

    def settle(self, entry_id: str, keys: Sequence[tuple[str, float]], amount: int) -> int:
        """Set the entry's amount in every key that still holds it; 0 removes it. Returns keys changed."""
        if amount < 0:
            raise ValueError("amount must be >= 0")
        now = self._clock.monotonic()
        changed = 0
        for key, window in keys:
            log = self._pruned(key, window, now)
            entry = log.by_id.get(entry_id) if log else None
            if log is None or entry is None:
                continue
            log.total += amount - entry.amount
            entry.amount = amount
            if amount == 0:
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
        if log is None:
            return None
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

    def _maybe_sweep(self, now: float) -> None:
        if self._longest == 0.0 or now - self._last_sweep < self._longest:
            return
        self._last_sweep = now
        idle = [k for k, log in self._logs.items() if not log.entries or now - log.entries[-1].at >= self._longest]
        for key in idle:
            del self._logs[key]


def _left(at: float, now: float, window: float) -> float:
    return min(max(window - (now - at), 0.0), window)
