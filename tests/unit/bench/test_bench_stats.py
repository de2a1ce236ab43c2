from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modeldock.bench.stats import Summary, nearest_rank, summarize


def test_nearest_rank_textbook_list() -> None:
    values = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert nearest_rank(values, 5) == 15.0  # rank ceil(0.25) = 1
    assert nearest_rank(values, 30) == 20.0  # rank ceil(1.5) = 2
    assert nearest_rank(values, 40) == 20.0  # rank exactly 2, not 3
    assert nearest_rank(values, 50) == 35.0  # rank ceil(2.5) = 3
    assert nearest_rank(values, 100) == 50.0


def test_single_value_is_every_percentile() -> None:
    for p in (0.1, 50, 95, 99, 100):
        assert nearest_rank([7.5], p) == 7.5


def test_p95_of_twenty_values_is_the_nineteenth() -> None:
    values = [float(v) for v in range(1, 21)]
    random.Random(3).shuffle(values)  # input order must not matter
    assert nearest_rank(values, 95) == 19.0
    assert nearest_rank(values, 99) == 20.0
    assert nearest_rank(values, 50) == 10.0


def test_rank_is_computed_exactly_not_in_floats() -> None:
    values = [float(v) for v in range(1, 101)]
    # 0.07 * 100 == 7.000000000000001 in floats, which would wrongly round up to 8.
    assert nearest_rank(values, 7) == 7.0
    assert nearest_rank(values, 99) == 99.0
    assert nearest_rank(values, 99.9) == 100.0


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        nearest_rank([], 50)
    with pytest.raises(ValueError):
        nearest_rank([1.0], 0)
    with pytest.raises(ValueError):
        nearest_rank([1.0], 101)


def test_summary_of_known_values() -> None:
    summary = summarize([3.0, 1.0, 2.0, 4.0])
    assert summary == Summary(count=4, mean=2.5, min=1.0, max=4.0, p50=2.0, p95=4.0, p99=4.0)


def test_summary_of_nothing_has_no_numbers() -> None:
    summary = summarize([])
    assert summary.count == 0
    assert summary.to_dict() == {
        "count": 0,
        "mean": None,
        "min": None,
        "max": None,
        "p50": None,
        "p95": None,
        "p99": None,
    }


@given(
    st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=1, max_size=200),
    st.integers(min_value=1, max_value=100),
)
def test_nearest_rank_definition(values: list[float], p: int) -> None:
    result = nearest_rank(values, p)
    n = len(values)
    assert result in values
    # At least p% of the values are <= the answer, and fewer than p% are below it.
    assert sum(v <= result for v in values) >= math.ceil(p * n / 100)
    assert sum(v < result for v in values) < math.ceil(p * n / 100)
