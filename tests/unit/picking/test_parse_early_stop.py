"""The parser's early stop gives the same Sample as reading the whole page, on real-shaped pages."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from modeldock.picking import parse_metrics
from modeldock.sim.config import SimConfig
from modeldock.sim.metrics import SimMetrics
from tests.support.vllm_page import vllm_metrics_page

pytestmark = pytest.mark.timeout(60)

MODEL = "/models/meta-llama/Llama-3.3-70B-Instruct"
OTHER = "other/model"


def _families(page: str) -> tuple[str, list[str]]:
    """The lines before the first family, and each family's group (its HELP line first)."""
    head, *families = page.split("# HELP ")
    return head, ["# HELP " + family for family in families]


def _same(page: str, model: str | None) -> None:
    for capacity in (False, True):
        assert parse_metrics(page, model, capacity=capacity) == parse_metrics(page, model, capacity=capacity,
                                                                              whole=True)


def test_the_simulators_page_stops_early_and_agrees() -> None:
    metrics = SimMetrics(SimConfig(model="demo-model"))
    metrics.running.set(3)
    metrics.waiting.set(2)
    metrics.kv_usage.set(0.4)
    metrics.prompt_tokens.inc(100)
    metrics.generation_tokens.inc(50)
    page = generate_latest(metrics.registry).decode()
    _same(page, "demo-model")
    sample = parse_metrics(page, "demo-model")
    assert sample is not None and (sample.waiting, sample.running, sample.tokens_total) == (2.0, 3.0, 150.0)


def test_the_stop_leaves_the_histograms_unread() -> None:
    page = vllm_metrics_page(MODEL)
    # Garbage after the last needed family's group cannot change the answer: it is never read.
    cut = page.index("# HELP vllm:request_success_total")
    extra = f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 1000\n'
    poisoned = page[:cut] + extra + page[cut:]
    assert parse_metrics(poisoned, MODEL) == parse_metrics(page, MODEL)
    whole = parse_metrics(poisoned, MODEL, whole=True)
    assert whole is not None and whole.waiting == 1007.0  # an invalid page (two groups of a family) read whole


def test_a_page_missing_a_needed_family_is_read_whole() -> None:
    page = vllm_metrics_page(MODEL, old_kv_name=True)  # gpu_cache_usage_perc only: kv_cache_usage_perc might follow
    _same(page, MODEL)
    head, families = _families(vllm_metrics_page(MODEL))
    no_counters = head + "".join(f for f in families if "generation_tokens_total" not in f)
    _same(no_counters, MODEL)


@settings(max_examples=60, deadline=None)
@given(
    engines=st.integers(1, 3),
    values=st.lists(st.tuples(st.integers(0, 64), st.integers(0, 256), st.floats(0, 1)), min_size=3, max_size=3),
    other=st.booleans(),
    old_kv=st.booleans(),
    seed=st.integers(0, 1000),
    order=st.randoms(use_true_random=False),
    drop=st.lists(st.integers(0, 80), max_size=6),
    model=st.sampled_from([MODEL, OTHER, None]),
)
def test_any_family_order_gives_the_whole_pages_sample(engines: int, values: list[tuple[int, int, float]],
                                                        other: bool, old_kv: bool, seed: int, order: random.Random,
                                                        drop: list[int], model: str | None) -> None:
    """Families shuffled (the text format only keeps each one's lines together) and some dropped."""
    page = vllm_metrics_page(MODEL, waiting=[float(v[0]) for v in values[:engines]],
                             running=[float(v[1]) for v in values[:engines]], kv=[v[2] for v in values[:engines]],
                             other_model=OTHER if other else None, old_kv_name=old_kv, seed=seed)
    head, families = _families(page)
    order.shuffle(families)
    kept = [f for i, f in enumerate(families) if i not in drop]
    _same(head + "".join(kept), model)
    _same("".join(kept), model)  # a page that starts with a family
