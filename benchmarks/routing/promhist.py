"""Prometheus histograms from /metrics text: sum over series, difference of two scrapes, quantiles.

Quantiles follow Prometheus' `histogram_quantile`: find the bucket the rank falls in and
interpolate linearly between its lower and upper edge (the first bucket's lower edge is 0). The
answer can be anywhere inside that bucket, so its error is up to the bucket's width; `bucket_of`
gives the edges for the report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Histogram:
    edges: tuple[float, ...]  # upper edges, ascending, +Inf last
    cumulative: tuple[float, ...]  # observations <= edge
    sum: float
    count: float

    def __sub__(self, other: Histogram) -> Histogram:
        if self.edges != other.edges:
            raise ValueError("histograms with different buckets")
        return Histogram(self.edges, tuple(a - b for a, b in zip(self.cumulative, other.cumulative, strict=True)),
                         self.sum - other.sum, self.count - other.count)

    def __add__(self, other: Histogram) -> Histogram:
        if self.edges != other.edges:
            raise ValueError("histograms with different buckets")
        return Histogram(self.edges, tuple(a + b for a, b in zip(self.cumulative, other.cumulative, strict=True)),
                         self.sum + other.sum, self.count + other.count)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """histogram_quantile(q): linear interpolation inside the bucket holding rank q * count."""
        if not self.count:
            return None
        rank = q * self.count
        lower_edge, lower_count = 0.0, 0.0
        for edge, cum in zip(self.edges, self.cumulative, strict=True):
            if cum >= rank:
                if math.isinf(edge):
                    return lower_edge  # as Prometheus: the highest finite edge
                if cum == lower_count:
                    return edge
                return lower_edge + (edge - lower_edge) * (rank - lower_count) / (cum - lower_count)
            lower_edge, lower_count = edge, cum
        return lower_edge

    def bucket_of(self, q: float) -> tuple[float, float] | None:
        """The (lower, upper] edges of the bucket holding rank q * count."""
        if not self.count:
            return None
        rank, lower = q * self.count, 0.0
        for edge, cum in zip(self.edges, self.cumulative, strict=True):
            if cum >= rank:
                return lower, edge
            lower = edge
        return lower, math.inf


def from_values(values: list[float], edges: tuple[float, ...]) -> Histogram:
    """`values` observed into a histogram with these upper edges (+Inf last), as Prometheus would."""
    cumulative = tuple(float(sum(1 for v in values if v <= edge)) for edge in edges)
    return Histogram(edges, cumulative, float(sum(values)), float(len(values)))


def parse_histogram(text: str, name: str) -> Histogram:
    """The histogram `name` (without _bucket/_sum/_count), summed over all its label sets."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                edge = float(sample.labels["le"])
                buckets[edge] = buckets.get(edge, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    if not buckets:
        raise KeyError(f"no histogram {name!r} in the page")
    edges = tuple(sorted(buckets))
    return Histogram(edges, tuple(buckets[e] for e in edges), total, count)
