from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest
from bench_fake_server import FakeOpenAI, Script

from modeldock.bench import BenchOptions, Progress, run_benchmark

StartServer = Callable[..., Awaitable[FakeOpenAI]]

# Generous upper slack: the client and server share one event loop on a possibly busy machine.
SLACK = 0.25


def num(value: float | None) -> float:
    assert value is not None
    return value


def leftover_workers() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("modeldock-bench-worker")]


async def test_timings_match_the_servers_known_delays(start_server: StartServer) -> None:
    script = Script(ttft_delay=0.15, gap=0.02, pieces=5, tokens_per_piece=2)
    server = await start_server(script)
    options = BenchOptions(
        url=server.base_url, model="m", requests=6, concurrency=(1, 3), warmup=1, usage=True, timeout=5, token="tok"
    )
    seen: list[Progress] = []
    result = await run_benchmark(options, progress=seen.append)

    assert server.arrivals == 2 * (1 + 6)  # warmup + measured, per tier
    assert [t.params.concurrency for t in result.tiers] == [1, 3]
    stream_span = (script.pieces - 1) * script.gap
    tokens = script.pieces * script.tokens_per_piece
    for tier in result.tiers:
        assert tier.completed == 6 and tier.errors == {}
        assert tier.params.warmup == 1 and tier.params.requests == 6 and tier.params.usage
        assert len(tier.records) == 6  # warmup requests are not in the results
        assert script.ttft_delay <= num(tier.ttft.min) and num(tier.ttft.max) < script.ttft_delay + SLACK
        assert script.ttft_delay + stream_span <= num(tier.e2e.min)
        assert num(tier.e2e.max) < script.ttft_delay + stream_span + SLACK
        # TPOT from usage: 4 gaps of 20 ms spread over 9 token intervals, not 4 chunk intervals.
        assert tier.tpot.count == 6
        assert stream_span / (tokens - 1) <= num(tier.tpot.min)
        assert num(tier.tpot.max) < (stream_span + 0.1) / (tokens - 1)
        assert tier.output_tokens_per_s == pytest.approx(6 * tokens / tier.wall_time_s)
        assert tier.requests_per_s == pytest.approx(6 / tier.wall_time_s)
    # Concurrency 3 overlaps requests: its wall time is well under the serial tier's.
    assert result.tiers[1].wall_time_s < result.tiers[0].wall_time_s * 0.7

    assert all(b["stream"] is True and b["stream_options"] == {"include_usage": True} for b in server.bodies)
    assert all(b["max_tokens"] == 128 and b["messages"][0]["role"] == "user" for b in server.bodies)
    assert set(server.auth_headers) == {"Bearer tok"}
    assert len({b["messages"][0]["content"] for b in server.bodies}) == len(server.bodies)
    assert [p.done for p in seen if p.phase == "measure" and p.concurrency == 3] == [1, 2, 3, 4, 5, 6]
    assert not leftover_workers()


async def test_without_usage_tpot_and_token_throughput_are_null(fake_openai: FakeOpenAI) -> None:
    options = BenchOptions(url=fake_openai.base_url, model="m", requests=3, concurrency=(2,), timeout=5)
    tier = (await run_benchmark(options)).tiers[0]
    assert tier.completed == 3
    assert tier.tpot.count == 0 and tier.tpot.p50 is None
    assert tier.output_tokens_per_s is None
    assert tier.ttft.count == 3
    assert all("stream_options" not in b for b in fake_openai.bodies)
    assert set(fake_openai.auth_headers) == {None}  # no token, no header


async def test_errors_are_counted_exactly_and_kept_out_of_latencies(start_server: StartServer) -> None:
    behaviours = {1: "429", 2: "500", 3: "truncate", 4: "cut", 5: "stall", 6: "stream_error", 7: "empty", 9: "429"}
    server = await start_server(Script(ttft_delay=0.05, gap=0.01, behaviours=behaviours, stall_seconds=3.0))
    options = BenchOptions(url=server.base_url, model="m", requests=12, concurrency=(3,), usage=True, timeout=0.6)
    tier = (await run_benchmark(options)).tiers[0]

    assert tier.errors == {"429": 2, "500": 1, "empty": 1, "stream_error": 1, "timeout": 1, "truncated": 2}
    assert tier.completed == 12 - 8
    for summary in (tier.ttft, tier.tpot, tier.e2e):
        assert summary.count == 4
    # The stalled request would have taken ≥ 0.6 s; nothing that slow is in the numbers.
    assert num(tier.e2e.max) < 0.05 + 0.04 + SLACK
    assert "scripted 429" in tier.error_details["429"]
    assert tier.requests_per_s == pytest.approx(4 / tier.wall_time_s)
    assert not leftover_workers()


async def test_concurrency_is_the_number_in_flight(start_server: StartServer) -> None:
    server = await start_server(Script(ttft_delay=0.1, gap=0.0, pieces=1))
    await run_benchmark(BenchOptions(url=server.base_url, model="m", requests=8, concurrency=(4,), timeout=5))
    assert server.max_in_flight == 4
    server.max_in_flight = 0
    await run_benchmark(BenchOptions(url=server.base_url, model="m", requests=3, concurrency=(1,), timeout=5))
    assert server.max_in_flight == 1


async def test_completions_endpoint(fake_openai: FakeOpenAI) -> None:
    options = BenchOptions(
        url=fake_openai.base_url + "/",
        model="m",
        requests=2,
        endpoint="completions",
        prompt_tokens=40,
        max_tokens=9,
        timeout=5,
    )
    tier = (await run_benchmark(options)).tiers[0]
    assert tier.completed == 2 and tier.params.endpoint == "completions"
    assert num(tier.ttft.min) >= fake_openai.script.ttft_delay
    assert set(fake_openai.paths) == {"/v1/completions"}
    body = fake_openai.bodies[0]
    assert len(body["prompt"].split()) == 40 and body["max_tokens"] == 9 and "messages" not in body


async def test_unreachable_server_is_a_transport_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the run: nothing listens
    options = BenchOptions(url=f"http://127.0.0.1:{port}/v1", model="m", requests=3, concurrency=(2,), timeout=2)
    tier = (await run_benchmark(options)).tiers[0]
    assert tier.errors == {"transport": 3}
    assert tier.completed == 0 and tier.ttft.count == 0 and tier.requests_per_s == 0
    assert not leftover_workers()
