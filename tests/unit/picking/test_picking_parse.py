from __future__ import annotations

import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from modeldock.picking import Sample, parse_metrics
from tests.support.vllm_page import vllm_metrics_page

MODEL = "/models/meta-llama/Llama-3.3-70B-Instruct"


def test_realistic_page_sums_engines_and_averages_kv() -> None:
    page = vllm_metrics_page(MODEL, waiting=(3, 4), running=(20, 22), kv=(0.25, 0.35))
    assert 80_000 < len(page) < 130_000  # the size of a real busy server's page
    assert page.count("_bucket{") > 600  # mostly histograms, like the real thing
    sample = parse_metrics(page, MODEL)
    assert sample is not None
    assert sample.waiting == 7.0
    assert sample.running == 42.0
    assert sample.kv == pytest.approx(0.30)


def test_other_models_series_are_ignored() -> None:
    page = vllm_metrics_page(MODEL, waiting=(1, 2), running=(3, 4), kv=(0.1, 0.2), other_model="other/model")
    sample = parse_metrics(page, MODEL)
    assert sample is not None
    assert (sample.waiting, sample.running) == (3.0, 7.0)
    assert sample.kv == pytest.approx(0.15)
    other = parse_metrics(page, "other/model")
    assert other is not None and (other.waiting, other.running, other.kv) == (1000.0, 1000.0, 1.0)
    assert parse_metrics(page, "not-served-here") is None
    everything = parse_metrics(page, None)
    assert everything is not None and everything.waiting == 1003.0


def test_old_kv_name_is_read() -> None:
    page = vllm_metrics_page(MODEL, waiting=(0,), running=(5,), kv=(0.8,), old_kv_name=True)
    assert "vllm:gpu_cache_usage_perc{" in page and "vllm:kv_cache_usage_perc" not in page
    sample = parse_metrics(page, MODEL)
    assert sample is not None and (sample.waiting, sample.running, sample.kv) == (0.0, 5.0, 0.8)


def test_new_kv_name_wins_when_both_are_exported() -> None:
    page = (
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
    )
    sample = parse_metrics(page, "m")
    assert sample is not None and sample.kv == 0.2


def test_underscore_spelling_and_no_labels() -> None:
    page = "# TYPE vllm_num_requests_waiting gauge\nvllm_num_requests_waiting 2\nvllm_num_requests_running 3.0\n"
    assert parse_metrics(page, "m") == Sample(waiting=2.0, running=3.0, kv=0.0)


def test_colon_spelling_wins_over_underscore_so_nothing_counts_twice() -> None:
    page = "vllm:num_requests_waiting 2\nvllm_num_requests_waiting 2\n"
    assert parse_metrics(page, "m") == Sample(waiting=2.0, running=0.0, kv=0.0)


def test_missing_series() -> None:
    assert parse_metrics("", "m") is None
    assert parse_metrics("# HELP x y\nprocess_open_fds 12.0\n", "m") is None
    only_kv = 'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
    assert parse_metrics(only_kv, "m") is None  # no queue signal: not a usable sample
    only_waiting = 'vllm:num_requests_waiting{model_name="m"} 4\n'
    assert parse_metrics(only_waiting, "m") == Sample(waiting=4.0, running=0.0, kv=0.0)


def test_lookalike_names_comments_and_timestamps() -> None:
    page = (
        "# HELP vllm:num_requests_waiting 99\n"
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 50\n'
        "xvllm:num_requests_waiting 70\n"
        'vllm:num_requests_waiting{model_name="m"} 5 1700000000000\n'
    )
    assert parse_metrics(page, "m") == Sample(waiting=5.0, running=0.0, kv=0.0)


def test_clamps_and_skips_bad_values() -> None:
    page = (
        'vllm:num_requests_running{engine="0",model_name="m"} NaN\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 3\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} -2\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} +Inf\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 1.7\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} nonsense\n'
    )
    assert parse_metrics(page, "m") == Sample(waiting=0.0, running=3.0, kv=1.0)


def test_label_quirks() -> None:
    tricky = 'we\\"ird\\\\name'  # escaped as Prometheus exposes it
    page = (
        'vllm:num_requests_waiting{model_name="we\\"ird\\\\name",x="}"} 2\n'
        'vllm:num_requests_waiting{served_model_name="m",model_name="other"} 100\n'
        'vllm:num_requests_waiting{served_model_name="other",model_name="m"} 1\n'
    )
    assert tricky  # documents the raw text above
    assert parse_metrics(page, 'we"ird\\name') == Sample(waiting=2.0, running=0.0, kv=0.0)
    assert parse_metrics(page, "m") == Sample(waiting=1.0, running=0.0, kv=0.0)


def test_first_line_of_page_counts() -> None:
    assert parse_metrics('vllm:num_requests_running{model_name="m"} 6\n', "m") == Sample(0.0, 6.0, 0.0)


@given(
    st.lists(
        st.tuples(st.integers(0, 500), st.integers(0, 512), st.floats(0, 1)), min_size=1, max_size=8
    )
)
def test_any_engine_mix_sums(engines: list[tuple[int, int, float]]) -> None:
    lines = []
    for i, (waiting, running, kv) in enumerate(engines):
        labels = f'engine="{i}",model_name="m"'
        lines += [f"vllm:num_requests_waiting{{{labels}}} {waiting}.0",
                  f"vllm:num_requests_running{{{labels}}} {running}.0",
                  f"vllm:kv_cache_usage_perc{{{labels}}} {kv!r}"]
    sample = parse_metrics("\n".join(lines) + "\n", "m")
    assert sample is not None
    assert sample.waiting == sum(e[0] for e in engines)
    assert sample.running == sum(e[1] for e in engines)
    assert math.isclose(sample.kv, sum(e[2] for e in engines) / len(engines), abs_tol=1e-9)
    assert 0.0 <= sample.kv <= 1.0


def test_parse_is_cheap_on_a_full_page() -> None:
    page = vllm_metrics_page(MODEL)
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        parse_metrics(page, MODEL)
        best = min(best, time.perf_counter() - start)
    assert best < 0.002  # ~50 µs on a laptop; a line-by-line Python parser would take ~1 ms


_PIECES = [*'{}"=, \n\t.-+0123456789eNIinf#\\', "vllm:num_requests_waiting", "vllm_num_requests_running",
           "vllm:kv_cache_usage_perc", "model_name=", '"m"', "engine=", "NaN", "+Inf"]


@given(st.lists(st.sampled_from(_PIECES), max_size=60).map("".join))
def test_junk_never_crashes(text: str) -> None:
    sample = parse_metrics(text, "m")
    if sample is not None:
        assert sample.waiting >= 0 and sample.running >= 0 and 0.0 <= sample.kv <= 1.0


def test_endpoint_shared_by_two_models_is_read_whole() -> None:
    from modeldock.clock import FakeClock
    from modeldock.picking import Picker
    from modeldock.types import Endpoint

    picker = Picker(FakeClock())
    shared, solo = Endpoint("10.0.0.1", 80), Endpoint("10.0.0.2", 80)
    picker.set_endpoints("a", [shared, solo])
    picker.set_endpoints("b", [shared])
    assert picker.scrape_targets() == {shared: None, solo: "a"}
