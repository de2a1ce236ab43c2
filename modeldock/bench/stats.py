"""Nearest-rank percentiles and the summary every latency list is reported with."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction


def nearest_rank(values: Sequence[float], p: float) -> float:
    """The p-th percentile by the nearest-rank method.

    rank = ceil(p/100 * n), 1-based, and the answer is the rank-th smallest
    value. It is always one of the observed values: nothing is interpolated.
    """
    if not values:
        raise ValueError("no values: a percentile of nothing is undefined")
    if not 0 < p <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {p}")
    n = len(values)
    # Exact arithmetic: 0.95 * 20 in floats must not round up to rank 20.
    rank = math.ceil(Fraction(str(p)) * n / 100)
    return sorted(values)[max(rank, 1) - 1]


@dataclass(frozen=True)
class Summary:
    """count/mean/min/max and nearest-rank p50/p95/p99; all None when count is 0."""

    count: int
    mean: float | None = None
    min: float | None = None
    max: float | None = None
    p50: float | None = None
    p95: float | None = None
    p99: float | None = None

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def summarize(values: Sequence[float]) -> Summary:
    if not values:
        return Summary(count=0)
    ordered = sorted(values)
    return Summary(
        count=len(ordered),
        mean=statistics.fmean(ordered),
        min=ordered[0],
        max=ordered[-1],
        p50=nearest_rank(ordered, 50),
        p95=nearest_rank(ordered, 95),
        p99=nearest_rank(ordered, 99),
    )
