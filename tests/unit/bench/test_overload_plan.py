"""The overload benchmark's pure parts (benchmarks/overload/plan.py): the config generator, the
seeded arrival schedules, the capacity window and the aggregation of outcomes. No network."""

from __future__ import annotations

import itertools
import json
import statistics

import pytest

from benchmarks.overload.plan import (
    CONFIGS,
    KIND_BLOCK,
    TENANTS,
    GatewayConfig,
    Mix,
    Outcome,
    aggregate,
    arrivals,
    back_above_zero,
    bootstrap_p95,
    by_class,
    by_tenant,
    capacity,
    clean_429,
    closed_loop_requests,
    counter_between,
    gateway_config,
    parse_config_arg,
    route,
    throughput,
)
from modeldock.config import hash_key, parse_config

ENDPOINTS = ["127.0.0.1:8001", "127.0.0.1:8002"]
CLEAN = json.dumps({"error": {"message": "All 3 endpoints are saturated", "type": "rate_limit_error",
                              "param": None, "code": "endpoints_saturated"}})


# -- configs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_every_listed_config_is_valid_today(cfg: GatewayConfig) -> None:
    parsed = parse_config(gateway_config(cfg, TENANTS, ENDPOINTS))
    assert [t.id for t in parsed.tenants] == [t.id for t in TENANTS]
    assert [f"{e.host}:{e.port}" for e in parsed.models[0].static_endpoints()] == ENDPOINTS


def test_each_tenant_has_its_own_key_hashed() -> None:
    data = gateway_config(CONFIGS[0], TENANTS, ENDPOINTS)
    hashes = [t["api_key_hashes"] for t in data["tenants"]]
    assert hashes == [[hash_key(t.key)] for t in TENANTS]
    assert len({h[0] for h in hashes}) == len(TENANTS)
    assert all(t.key not in json.dumps(data) for t in TENANTS)


def test_the_lineup_compares_the_previous_default_with_the_out_of_the_box_config() -> None:
    by_name = {c.name: parse_config(gateway_config(c, TENANTS, ENDPOINTS)) for c in CONFIGS}
    before, threshold, queue = by_name["noqueue"], by_name["threshold"], by_name["queue"]
    for old in (before, threshold):  # the previous default: no queue, no room rule, the old weights
        assert not old.queue.enabled and not old.routing.saturation.room
        assert old.routing.weights["kv"] == 0.3 and old.routing.weights["kv_headroom"] == 0
    assert (before.routing.saturation.max_waiting, before.routing.saturation.max_kv) == (None, None)
    assert (threshold.routing.saturation.max_waiting, threshold.routing.saturation.max_kv) == (1, 0.92)
    default = parse_config({"models": [{"name": "m", "endpoints": ENDPOINTS}]})
    assert queue.queue == default.queue and queue.routing == default.routing  # nothing added to the default
    assert queue.queue.enabled and queue.routing.saturation.room


def test_queue_fields_pass_through() -> None:
    cfg = GatewayConfig("q", "q", extra={"queue": {"ttl_seconds": 2}}, tenant_fields=True)
    data = gateway_config(cfg, TENANTS, ENDPOINTS)
    assert data["queue"] == {"ttl_seconds": 2}
    ivy = next(t for t in data["tenants"] if t["id"] == "ivy")
    assert (ivy["weight"], ivy["priority"]) == (1.0, "interactive")
    data["queue"]["ttl_seconds"] = 5  # the generated dict is a copy
    assert cfg.extra == {"queue": {"ttl_seconds": 2}}


def test_the_pool_declares_its_batch_limit_unless_a_contender_removes_it() -> None:
    pool = {"max_num_seqs": 4}
    for cfg in CONFIGS:
        assert parse_config(gateway_config(cfg, TENANTS, ENDPOINTS, pool=pool)).model("demo-model").max_num_seqs == 4
    learn = parse_config_arg('learn={"model": {"max_num_seqs": null}}', CONFIGS)
    assert parse_config(gateway_config(learn, TENANTS, ENDPOINTS, pool=pool)).model("demo-model").max_num_seqs is None


def test_config_arg_adjusts_a_known_config_or_adds_one() -> None:
    changed = parse_config_arg('queue={"extra": {"queue": {}}, "tenant_fields": true}', CONFIGS)
    assert (changed.name, changed.extra, changed.tenant_fields) == ("queue", {"queue": {}}, True)
    assert changed.description == next(c for c in CONFIGS if c.name == "queue").description
    added = parse_config_arg('kv={"routing": {"saturation": {"max_kv": 0.8}}}', CONFIGS)
    assert (added.name, added.routing) == ("kv", {"saturation": {"max_kv": 0.8}})
    for bad in ("noequals", '={"routing": {}}', 'x={"policy": "seed"}', "x=[1]"):
        with pytest.raises(ValueError):
            parse_config_arg(bad, CONFIGS)


# -- arrivals -----------------------------------------------------------------------------------


def test_arrivals_are_seeded_and_differ_by_label() -> None:
    mix = Mix()
    a, b = arrivals(3, "nA", 20.0, 10.0, mix), arrivals(3, "nA", 20.0, 10.0, mix)
    assert a == b
    assert [r.at for r in a] != [r.at for r in arrivals(3, "nB", 20.0, 10.0, mix)]
    assert [r.at for r in a] != [r.at for r in arrivals(4, "nA", 20.0, 10.0, mix)]


def test_arrivals_rate_window_mix_and_indexes() -> None:
    mix = Mix(long_fraction=0.25, short_tokens=16, long_tokens=300, prompt_tokens=(10, 20))
    reqs = arrivals(1, "x", 50.0, 40.0, mix, first_index=7, start=2.0)
    assert abs(len(reqs) - 2000) < 4 * 2000 ** 0.5  # Poisson: mean 2000, sd ~45
    assert all(2.0 <= r.at < 42.0 for r in reqs)
    assert [r.at for r in reqs] == sorted(r.at for r in reqs)
    assert [r.index for r in reqs] == list(range(7, 7 + len(reqs)))
    longs = [r for r in reqs if r.kind == "long"]
    assert abs(len(longs) / len(reqs) - 0.25) < 0.04
    assert {r.max_tokens for r in longs} == {300}
    assert {r.max_tokens for r in reqs if r.kind == "short"} == {16}
    assert all(10 <= r.prompt_tokens <= 20 and len(r.messages[0]["content"]) == 4 * r.prompt_tokens for r in reqs)
    gaps = [b.at - a.at for a, b in itertools.pairwise(reqs)]
    assert abs(statistics.fmean(gaps) - 1 / 50) < 0.003  # exponential gaps of mean 1/rate
    assert len({r.messages[0]["content"][:16] for r in reqs}) == len(reqs)  # no shared prefix block


def test_every_block_of_a_schedule_has_the_mixs_long_fraction() -> None:
    # A capacity run and an overload phase then see the same mix, whatever stretch each takes.
    for fraction, per_block in ((0.2, [4]), (0.25, [5]), (0.33, [7, 6])):
        reqs = arrivals(5, "ovl", 40.0, 30.0, Mix(long_fraction=fraction))
        counts = [sum(r.kind == "long" for r in reqs[i:i + KIND_BLOCK])
                  for i in range(0, len(reqs) - KIND_BLOCK + 1, KIND_BLOCK)]
        assert set(counts) == set(per_block), (fraction, counts)
        longs = sum(r.kind == "long" for r in reqs[:len(counts) * KIND_BLOCK])
        assert abs(longs - fraction * len(counts) * KIND_BLOCK) <= 0.5
        # Within a block the order is drawn: not every block the same.
        assert len({tuple(r.kind for r in reqs[i:i + KIND_BLOCK]) for i in range(0, 200, KIND_BLOCK)}) > 1


def test_only_short_has_no_long_requests_and_closed_loop_count() -> None:
    assert {r.kind for r in arrivals(1, "i", 30.0, 5.0, Mix().only_short())} == {"short"}
    reqs = closed_loop_requests(1, 500, Mix())
    assert len(reqs) == 500 and len({r.index for r in reqs}) == 500


# -- capacity -----------------------------------------------------------------------------------


def test_throughput_counts_only_the_window() -> None:
    assert throughput([0.5, 1.0, 1.5, 2.0, 2.99, 3.0], 1.0, 3.0) == 2.0  # 1.0, 1.5, 2.0, 2.99
    with pytest.raises(ValueError):
        throughput([], 2.0, 2.0)


def test_capacity_skips_warmup_and_failures() -> None:
    t0 = 100.0
    # 10 completions per second from t0 to t0 + 10; two failures (end -inf, ttft None).
    ends = [t0 + i / 10 for i in range(100)] + [float("-inf"), float("-inf")]
    ttfts = [0.01 * (i % 10 + 1) for i in range(100)] + [None, None]
    cap = capacity(ends, ttfts, t0, warmup=2.0, duration=10.0, concurrency=12)
    assert cap.completed == 80 and cap.window_s == 8.0
    assert cap.rate == pytest.approx(10.0)
    assert cap.concurrency == 12
    assert cap.ttft_p95 == pytest.approx(0.10)


# -- outcomes -----------------------------------------------------------------------------------


def test_clean_429_checks_the_openai_shape() -> None:
    assert clean_429(CLEAN) is True
    assert clean_429('{"error": {"message": "x", "type": "t", "code": "c"}}') is False  # no param
    assert clean_429('{"error": "busy"}') is False
    assert clean_429("<html>Too Many Requests</html>") is False
    assert clean_429(None) is False
    assert clean_429(CLEAN[:-1] + " " * 300) is None  # cut at 300 characters: cannot tell


def test_aggregate_counts_shares_and_served_percentiles() -> None:
    served = [Outcome("a", None, ttft=0.01 * i, e2e=0.1 * i) for i in range(1, 21)]
    rejected = [Outcome("a", "429", None, None, CLEAN)] * 3 + [Outcome("b", "429", None, None, "oops")]
    other = [Outcome("b", "timeout", None, None), Outcome("b", "503", None, None, CLEAN)]
    agg = aggregate(served + rejected + other)
    assert (agg["offered"], agg["served"], agg["r429"]) == (26, 20, 4)
    assert agg["served_pct"] == pytest.approx(100 * 20 / 26)
    assert agg["r429_pct"] == pytest.approx(100 * 4 / 26)
    assert (agg["r429_clean"], agg["r429_unclean"], agg["r429_unchecked"]) == (3, 1, 0)
    assert agg["other_errors"] == {"timeout": 1, "503": 1}
    assert agg["ttft_p50"] == pytest.approx(0.10) and agg["ttft_p95"] == pytest.approx(0.19)
    assert agg["ttft_p99"] == pytest.approx(0.20) and agg["e2e_p95"] == pytest.approx(1.9)
    tenants = by_tenant(served + rejected + other)
    assert tenants["a"]["served"] == 20 and tenants["a"]["r429"] == 3
    assert tenants["b"]["served"] == 0 and tenants["b"]["ttft_p95"] is None and tenants["b"]["r429_unclean"] == 1


def test_aggregate_of_nothing() -> None:
    agg = aggregate([])
    assert agg["offered"] == 0 and agg["served_pct"] is None and agg["ttft_p95"] is None


def test_bootstrap_interval_holds_the_p95() -> None:
    values = [i / 1000 for i in range(1, 401)]
    interval = bootstrap_p95(values, seed=1)
    assert interval is not None
    lo, hi = interval
    assert lo <= 0.380 <= hi and hi - lo < 0.05
    assert bootstrap_p95([0.1]) is None


def test_by_class_keeps_short_and_long_apart() -> None:
    # 19 short answers at 10..190 ms and 5 long ones at 1..5 s: pooled, the p95 lands in the long class.
    short = [Outcome("a", None, ttft=0.01 * i, e2e=0.1, kind="short") for i in range(1, 20)]
    long = [Outcome("a", None, ttft=float(i), e2e=9.0, kind="long") for i in range(1, 6)]
    unknown = [Outcome("a", "429", None, None, CLEAN)]  # no class (results saved before classes): left out
    classes = by_class(short + long + unknown)
    assert set(classes) == {"short", "long"}
    assert classes["short"]["offered"] == 19 and classes["short"]["ttft_p95"] == pytest.approx(0.19)
    assert classes["long"]["offered"] == 5 and classes["long"]["ttft_p95"] == pytest.approx(5.0)
    assert aggregate(short + long)["ttft_p95"] == pytest.approx(4.0)  # pooled: 23rd of 24
    assert by_class([]) == {}


# -- replicas -----------------------------------------------------------------------------------


def test_route_is_round_robin_and_skips_a_dead_replica() -> None:
    assert [route(n, [True, True, True]) for n in range(6)] == [0, 1, 2, 0, 1, 2]
    # Replica 1 down: its arrivals go to the next live one (2); replica 2 down: wrap to 0.
    assert [route(n, [True, False, True]) for n in range(6)] == [0, 2, 2, 0, 2, 2]
    assert [route(n, [True, True, False]) for n in range(3)] == [0, 1, 0]
    assert route(1, [True]) == 0  # "through replica 1" with one replica: the only one
    with pytest.raises(ValueError):
        route(0, [False, False])


def test_counter_between_reads_the_growth_over_a_window() -> None:
    samples = [(-0.2, 3.0), (1.0, 5.0), (2.0, 9.0), (3.0, 10.0), (4.0, 20.0)]
    assert counter_between(samples, 1.5, 3.5) == 5.0  # 10 at 3.0 minus 5 at 1.0
    assert counter_between(samples, 0.0, 1.0) == 2.0
    assert counter_between(samples, 4.0, 9.0) == 0.0
    assert counter_between(samples, -1.0, 2.0) is None  # nothing read before the window


def test_back_above_zero_times_the_first_positive_sample_after() -> None:
    samples = [(0.0, 2.0), (1.0, 0.0), (1.5, None), (2.0, 0.0), (2.7, 1.0), (3.0, 2.0)]
    assert back_above_zero(samples, 1.0) == pytest.approx(1.7)
    assert back_above_zero(samples, 2.8) == pytest.approx(0.2)
    assert back_above_zero(samples, 3.5) is None
    assert back_above_zero([(0.5, None), (1.0, None)], 0.0) is None  # not exported
