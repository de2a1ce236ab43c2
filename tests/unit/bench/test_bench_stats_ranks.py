"""Summary percentiles on a list long enough that p95, p96, p99 and p100 are different values,
and the wording of the errors a bad percentile request gets."""

from __future__ import annotations

import pytest

from modeldock.bench.stats import nearest_rank, summarize


def test_summary_percentiles_of_two_hundred_values() -> None:
    values = [float(v) for v in range(200, 0, -1)]  # 200..1, unsorted on purpose
    summary = summarize(values)
    # Nearest rank over 1..200: the p-th percentile is the value ceil(p * 2).
    assert (summary.p50, summary.p95, summary.p99) == (100.0, 190.0, 198.0)
    assert (summary.min, summary.max, summary.count, summary.mean) == (1.0, 200.0, 200, 100.5)


def test_errors_say_what_was_wrong() -> None:
    with pytest.raises(ValueError, match=r"^no values: a percentile of nothing is undefined$"):
        nearest_rank([], 50)
    with pytest.raises(ValueError, match=r"^percentile must be in \(0, 100\], got 101$"):
        nearest_rank([1.0], 101)
