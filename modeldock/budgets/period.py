"""Calendar periods for token and cost budgets: the day or month that contains an instant, in a time zone.

    periods = Periods()
    period = periods.current("month", clock.time(), "Europe/Berlin")   # Period(label, start, end)
    key = budget_key(tenant_id, f"month:{period.label}")              # one counter per period

A period budget is a counter for the period that contains the reservation time, not a sliding window:
it resets exactly at the period's start in its zone. Boundaries are local midnights computed with
zoneinfo, so a day is 23 or 25 hours long across a DST change and a month is its calendar length. In
the windows a counter is marked by a negative length (`period_window`): no entry expires by time (the
key names the period), and the key lives that many seconds after its last reservation.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Literal
from zoneinfo import ZoneInfo

PeriodKind = Literal["day", "month"]

# How long a period's counter outlives its last reservation (late settlements, replicas' clock skew):
# a little more than the period itself.
_KEEP_S: dict[PeriodKind, float] = {"day": 2 * 86_400.0, "month": 33 * 86_400.0}


def period_window(kind: PeriodKind) -> float:
    """The window length that marks a counter of `kind` (negative: see the module docstring)."""
    return -_KEEP_S[kind]


def is_period(window: float) -> bool:
    return window < 0


@dataclass(frozen=True, slots=True)
class Period:
    label: str  # "2026-12-31" or "2026-12": part of the counter's key
    start: float  # epoch seconds of the first instant of the period in its zone
    end: float  # epoch seconds of the first instant of the next period


@lru_cache(maxsize=64)
def zone(name: str) -> ZoneInfo:
    return ZoneInfo(name)


def period_at(kind: PeriodKind, now: float, tz: str) -> Period:
    """The period of `kind` that contains the instant `now` (epoch seconds) in zone `tz`."""
    zi = zone(tz)
    local = datetime.fromtimestamp(now, zi)
    if kind == "day":
        first = local.replace(hour=0, minute=0, second=0, microsecond=0, fold=0)
        following = first.date() + timedelta(days=1)
        label = first.strftime("%Y-%m-%d")
    else:
        first = local.replace(day=1, hour=0, minute=0, second=0, microsecond=0, fold=0)
        following = (first.date().replace(day=28) + timedelta(days=4)).replace(day=1)
        label = first.strftime("%Y-%m")
    nxt = datetime(following.year, following.month, following.day, tzinfo=zi)
    # A local midnight that falls in a DST gap does not exist: fold=0 maps it to the gap's end, the
    # period's first real instant. One that occurs twice starts the period at its first occurrence.
    return Period(label, first.timestamp(), nxt.timestamp())


class Periods:
    """`period_at`, remembered per (kind, zone) while the instant stays inside it (the request path)."""

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[tuple[PeriodKind, str], Period] = {}

    def current(self, kind: PeriodKind, now: float, tz: str) -> Period:
        cached = self._cache.get((kind, tz))
        if cached is not None and cached.start <= now < cached.end:
            return cached
        period = self._cache[(kind, tz)] = period_at(kind, now, tz)
        return period
