"""The routing benchmark's workload generators (benchmarks/routing/workloads.py) and its
histogram helper: seeded, the right mix, real bursts, real shared prefixes. No network."""

from __future__ import annotations

import math

import pytest

from benchmarks.routing.promhist import Histogram, from_values
from benchmarks.routing.workloads import CHARS_PER_TOKEN, bursts, mixed, shared_prefix, text
from modeldock.sim.tokens import CHARS_PER_TOKEN as SIM_CHARS_PER_TOKEN
from modeldock.sim.tokens import render_chat, text_prompt

BLOCK = 16  # the simulator's default --block-size


def rendered(request) -> str:
    return render_chat(request.messages)


def test_token_size_matches_the_simulator() -> None:
    assert CHARS_PER_TOKEN == SIM_CHARS_PER_TOKEN


@pytest.mark.parametrize("tokens", [1, 3, 16, 100, 2048])
def test_text_has_exactly_the_asked_length(tokens: int) -> None:
    import random

    body = text(tokens, random.Random(1), head="h1")
    assert len(body) == tokens * CHARS_PER_TOKEN
    assert body.startswith("h1")
    assert text_prompt(body, BLOCK).num_tokens == tokens


def test_text_needs_a_token() -> None:
    import random

    with pytest.raises(ValueError):
        text(0, random.Random(1))


@pytest.mark.parametrize("make", [mixed, bursts, shared_prefix])
def test_same_seed_same_requests_other_seed_other_requests(make) -> None:
    a, b, c = make(5, duration=3.0), make(5, duration=3.0), make(6, duration=3.0)
    assert a == b
    assert a.requests != c.requests
    assert [r.index for r in a.requests] == list(range(len(a.requests)))
    assert [r.at for r in a.requests] == sorted(r.at for r in a.requests)


def test_mixed_is_80_20_with_the_right_lengths() -> None:
    w = mixed(1, duration=500.0, warmup=0.0, rate=20.0, prompt_tokens=(1, 4))
    n = len(w.requests)
    # Poisson count: mean 10,000, sd 100.
    assert abs(n - 10_000) < 500
    longs = [r for r in w.requests if r.kind == "long"]
    shorts = [r for r in w.requests if r.kind == "short"]
    assert len(longs) + len(shorts) == n
    # Binomial(10k, 0.2): sd 0.004; allow 5 sd.
    assert abs(len(longs) / n - 0.2) < 0.02
    assert {r.max_tokens for r in longs} == {1000} and {r.max_tokens for r in shorts} == {32}
    assert 1000 / 32 == 2000 / 64  # the scaled lengths keep the 64 : 2,000 ratio
    assert all(0 <= r.at < 500.0 for r in w.requests)


def test_mixed_warmup_arrivals_are_sent_but_not_measured() -> None:
    w = mixed(2, duration=4.0, warmup=2.0, rate=30.0)
    assert w.warmup == 2.0
    assert any(not r.measured for r in w.requests)
    assert all(r.measured == (r.at >= 2.0) for r in w.requests)
    assert all(r.at < 6.0 for r in w.requests)
    assert w.measured == tuple(r for r in w.requests if r.at >= 2.0)


@pytest.mark.parametrize("make", [mixed, bursts])
def test_unique_prompts_share_no_prefix_cache_block(make) -> None:
    """Every prompt differs inside its first 16-token block, so no request can reuse another's cache."""
    w = make(3, duration=6.0)
    firsts = [text_prompt(rendered(r), BLOCK).block_hashes[0] for r in w.requests]
    assert len(set(firsts)) == len(firsts)
    for r in w.requests:
        assert len(r.messages[0]["content"]) == r.prompt_tokens * CHARS_PER_TOKEN


def test_bursts_arrive_together_at_the_planned_times() -> None:
    w = bursts(1, duration=10.0, every=2.0, size=8, spread=0.05, background_rate=12.0)
    burst = [r for r in w.requests if r.kind == "burst"]
    background = [r for r in w.requests if r.kind == "background"]
    groups: dict[int, list] = {}
    for r in burst:
        groups.setdefault(r.group, []).append(r)
    assert sorted(groups) == [0, 1, 2, 3, 4]  # at 1, 3, 5, 7, 9 s
    for k, members in groups.items():
        start = 1.0 + 2.0 * k
        assert len(members) == 8
        assert all(start <= r.at <= start + 0.05 for r in members)
        assert all(2048 <= r.prompt_tokens <= 4096 for r in members)
        assert all(r.max_tokens == 64 for r in members)
    assert all(r.group is None and r.max_tokens == 32 and r.prompt_tokens <= 512 for r in background)
    assert abs(len(background) - 120) < 5 * math.sqrt(120)
    # Between bursts only background traffic arrives.
    quiet = [r for r in w.requests if 1.2 < r.at < 2.9]
    assert quiet and all(r.kind == "background" for r in quiet)


def test_shared_prefixes_really_share_their_first_tokens() -> None:
    w = shared_prefix(1, duration=5.0, groups=4, prefix_tokens=512, rate=40.0)
    by_group: dict[int, list] = {}
    for r in w.requests:
        by_group.setdefault(r.group, []).append(r)
    assert sorted(by_group) == [0, 1, 2, 3]
    shared_chars = len("<|system|>\n") + 512 * CHARS_PER_TOKEN
    shared_blocks = shared_chars // (BLOCK * CHARS_PER_TOKEN)
    heads = {}
    for group, members in by_group.items():
        assert len(members) > 5
        texts = [rendered(r) for r in members]
        # The first 512 tokens of content (plus the template's header) are the same text ...
        assert len({t[:shared_chars] for t in texts}) == 1
        # ... so the simulator's chained block hashes agree on every full block of it ...
        hashes = [text_prompt(t, BLOCK).block_hashes for t in texts]
        assert len({h[:shared_blocks] for h in hashes}) == 1
        # ... and part ways after it: each request's question is its own.
        assert len({h[shared_blocks + 2] for h in hashes if len(h) > shared_blocks + 2}) == len(
            [h for h in hashes if len(h) > shared_blocks + 2])
        heads[group] = hashes[0][0]
    # Different groups share nothing, not even the first block.
    assert len(set(heads.values())) == 4
    assert all(r.prompt_tokens == 512 + len(r.messages[1]["content"]) // CHARS_PER_TOKEN for r in w.requests)


def test_histogram_quantile_interpolates_inside_the_bucket() -> None:
    edges = (0.1, 0.2, 0.5, math.inf)
    h = from_values([0.05, 0.15, 0.15, 0.3], edges)
    assert h.cumulative == (1.0, 3.0, 4.0, 4.0)
    assert h.mean == pytest.approx(0.1625)
    # rank 2 of 4 falls in (0.1, 0.2], halfway between its 1st and 3rd observation.
    assert h.quantile(0.5) == pytest.approx(0.15)
    assert h.bucket_of(0.5) == (0.1, 0.2)
    assert h.quantile(1.0) == pytest.approx(0.5)
    diff = from_values([0.05, 0.15, 0.15, 0.3, 0.4], edges) - h
    assert diff == Histogram(edges, (0.0, 0.0, 1.0, 1.0), pytest.approx(0.4), 1.0)
    assert from_values([], edges).quantile(0.5) is None


def test_envoy_log_diagnostics(tmp_path) -> None:
    from benchmarks.routing import envoy_log

    lines = [
        '[2026-01-01T00:00:00.000Z] "POST /v1/chat/completions" 200 - attempts=1 upstream=10.0.0.1:80 rx=9000 '
        'tx=200000 dur=1000ms ttfb=2ms id=a',
        '[2026-01-01T00:00:00.010Z] "POST /v1/chat/completions" 200 - attempts=1 upstream=10.0.0.1:80 rx=9000 '
        'tx=5000 dur=500ms ttfb=2ms id=b',
        '[2026-01-01T00:00:00.020Z] "POST /v1/chat/completions" 200 - attempts=1 upstream=10.0.0.2:80 rx=9000 '
        'tx=5000 dur=100ms ttfb=2ms id=c',
        '[2026-01-01T00:00:02.000Z] "POST /v1/chat/completions" 200 - attempts=1 upstream=10.0.0.2:80 rx=100 '
        'tx=5000 dur=100ms ttfb=2ms id=d',
        '[2026-01-01T00:00:02.000Z] "GET /v1/models" 200 - attempts=1 upstream=- rx=0 tx=50 dur=1ms ttfb=1ms id=e',
        "some other line",
    ]
    log = tmp_path / "envoy.log"
    log.write_text("\n".join(lines) + "\n")
    entries = envoy_log.parse(log)
    assert [e.upstream for e in entries] == ["10.0.0.1:80", "10.0.0.1:80", "10.0.0.2:80", "10.0.0.2:80"]
    t0 = entries[0].start
    assert entries[0].end - t0 == pytest.approx(1.0)
    assert entries[0].ttfb == pytest.approx(0.002)
    assert envoy_log.peak(entries) == 2
    assert envoy_log.peak(entries, lambda e: e.tx > 40_000) == 1
    # 10.0.0.1 holds 2 requests from 0.010 to 0.510 s: over 1 slot for 0.5 s of the first 1 s.
    assert envoy_log.over_slots(entries, t0, t0 + 1.0, slots=1) == pytest.approx(0.5, abs=0.01)
    groups = envoy_log.bursts(entries, min_rx=6000)
    assert [dict(g) for g in groups] == [{"10.0.0.1:80": 2, "10.0.0.2:80": 1}]
    assert envoy_log.burst_max_mean(entries, 6000) == 2.0
    assert len(envoy_log.within(entries, t0 + 1.5, t0 + 3.0)) == 1
