"""Requests in flight per tenant, counted in this process."""

from __future__ import annotations


class Slot:
    """One request in flight. `release()` may be called any number of times."""

    __slots__ = ("_key", "_owner", "released")

    def __init__(self, owner: ConcurrencyLimiter, key: str) -> None:
        self._owner = owner
        self._key = key
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._owner._release(self._key)


class ConcurrencyLimiter:
    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}

    def try_acquire(self, key: str, limit: int) -> Slot | None:
        """A slot, or None when `limit` requests are already in flight. limit 0 means unlimited.

        Unlimited keys are counted too, so a reload that adds a limit starts from
        the true number in flight.
        """
        current = self._in_flight.get(key, 0)
        if limit > 0 and current >= limit:
            return None
        self._in_flight[key] = current + 1
        return Slot(self, key)

    def in_flight(self, key: str) -> int:
        return self._in_flight.get(key, 0)

    def total(self) -> int:
        return sum(self._in_flight.values())

    def _release(self, key: str) -> None:
        left = self._in_flight.get(key, 0) - 1
        if left > 0:
            self._in_flight[key] = left
        else:
            # Drop idle keys so memory follows tenants with traffic, not all tenants ever seen.
            self._in_flight.pop(key, None)
