"""The Scraper against real local aiohttp servers (real time: the only test here that waits)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from modeldock.clock import SystemClock
from modeldock.picking import Picker, Scraper
from modeldock.types import Endpoint
from tests.support.vllm_page import vllm_metrics_page

MODEL = "/models/meta-llama/Llama-3.3-70B-Instruct"
UNSET = Endpoint("127.0.0.1", 1)


@dataclass
class FakeVllm:
    """One fake server: its page follows `waiting`; `mode` makes it misbehave."""

    waiting: tuple[float, float] = (1.0, 2.0)
    mode: str = "ok"  # ok | hang | error | empty
    requests: int = 0
    peers: set[object] = field(default_factory=set)
    endpoint: Endpoint = UNSET  # set once the server listens
    release: asyncio.Event = field(default_factory=asyncio.Event)
    page: str | None = None  # served as is when set

    async def metrics(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        if self.mode == "hang":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.release.wait(), timeout=5)
        if self.mode == "error":
            return web.Response(status=500, text="engine dead")
        if self.mode == "empty":
            return web.Response(text="# nothing from vLLM here\nprocess_open_fds 3.0\n")
        if self.page is not None:
            return web.Response(text=self.page, content_type="text/plain")
        page = vllm_metrics_page(MODEL, waiting=self.waiting, running=(10.0, 10.0), kv=(0.5, 0.7))
        return web.Response(text=page, content_type="text/plain")


@pytest.fixture
async def servers() -> AsyncIterator[list[FakeVllm]]:
    fakes = [FakeVllm() for _ in range(4)]
    runners = []
    for fake in fakes:
        app = web.Application()
        app.router.add_get("/metrics", fake.metrics)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        fake.endpoint = Endpoint("127.0.0.1", runner.addresses[0][1])
    yield fakes
    for fake in fakes:
        fake.release.set()
    for runner in runners:
        await runner.cleanup()


def _eps(fakes: list[FakeVllm]) -> list[Endpoint]:
    return [fake.endpoint for fake in fakes]


async def test_round_feeds_changing_samples_and_survives_a_hung_endpoint(servers: list[FakeVllm]) -> None:
    ok, changing, hung, _ = servers
    hung.mode = "hang"
    picker = Picker(SystemClock())
    picker.set_endpoints("llama", _eps(servers[:3]), served_name=MODEL)
    registry = CollectorRegistry()
    scraper = Scraper(picker, SystemClock(), timeout=0.3, budget=0.6, registry=registry)
    try:
        started = time.monotonic()
        result = await scraper.scrape_once()
        elapsed = time.monotonic() - started
        assert elapsed < 0.6 + 0.3  # the hung endpoint cost at most its timeout
        assert set(result.samples) == {ok.endpoint, changing.endpoint}
        assert result.failures == {hung.endpoint: "timeout"}
        sample = picker.signals(changing.endpoint).sample
        assert sample is not None
        assert (sample.waiting, sample.running) == (3.0, 20.0)
        assert sample.kv == pytest.approx(0.6)
        assert registry.get_sample_value("modeldock_scrape_errors_total", {"reason": "timeout"}) == 1
        assert registry.get_sample_value("modeldock_scrape_round_seconds_count") == 1

        changing.waiting = (7.0, 0.0)
        await scraper.scrape_once()
        sample = picker.signals(changing.endpoint).sample
        assert sample is not None and sample.waiting == 7.0
        assert len(ok.peers) == 1 and ok.requests == 2  # one kept-alive connection across rounds
    finally:
        await scraper.stop()


async def test_round_budget_caps_slow_endpoints(servers: list[FakeVllm]) -> None:
    servers[0].mode = "hang"
    servers[1].mode = "hang"
    picker = Picker(SystemClock())
    picker.set_endpoints("llama", _eps(servers), served_name=MODEL)
    scraper = Scraper(picker, SystemClock(), timeout=10.0, budget=0.4)
    try:
        started = time.monotonic()
        result = await scraper.scrape_once()
        assert time.monotonic() - started < 0.4 + 0.3
        assert set(result.failures) == {servers[0].endpoint, servers[1].endpoint}
        assert set(result.samples) == {servers[2].endpoint, servers[3].endpoint}
    finally:
        await scraper.stop()


async def test_failure_reasons(servers: list[FakeVllm]) -> None:
    servers[0].mode = "error"
    servers[1].mode = "empty"
    closed = Endpoint("127.0.0.1", 1)  # nothing listens on port 1
    picker = Picker(SystemClock())
    picker.set_endpoints("llama", [*_eps(servers[:3]), closed], served_name=MODEL)
    picker.set_endpoints("other", [servers[3].endpoint])  # its page serves MODEL, not "other"
    scraper = Scraper(picker, SystemClock(), timeout=0.5, budget=1.0)
    try:
        result = await scraper.scrape_once()
    finally:
        await scraper.stop()
    assert result.failures == {
        servers[0].endpoint: "http_status",
        servers[1].endpoint: "no_series",
        closed: "connect",
        servers[3].endpoint: "no_series",
    }
    assert set(result.samples) == {servers[2].endpoint}


async def test_background_loop_follows_endpoint_changes(servers: list[FakeVllm]) -> None:
    first, second, *_ = servers
    picker = Picker(SystemClock())
    picker.set_endpoints("llama", [first.endpoint], served_name=MODEL)
    async with Scraper(picker, SystemClock(), interval=0.05, timeout=0.3, budget=0.5):
        await _until(lambda: first.requests >= 2)
        picker.set_endpoints("llama", [second.endpoint], served_name=MODEL)
        await _until(lambda: second.requests >= 2)
        seen = first.requests
        await asyncio.sleep(0.15)
        assert first.requests <= seen + 1  # at most one round was already under way
        assert picker.signals(second.endpoint).fresh
    assert picker.signals(first.endpoint).sample is None  # forgotten with the endpoint


async def test_a_request_ending_reads_its_endpoint_again_out_of_turn(servers: list[FakeVllm]) -> None:
    first, second, *_ = servers
    picker = Picker(SystemClock())
    picker.set_endpoints("llama", [first.endpoint, second.endpoint], served_name=MODEL)
    registry = CollectorRegistry()
    # Rounds every 30 s: after the first, only a request ending reads a page.
    async with Scraper(picker, SystemClock(), interval=30.0, timeout=0.3, budget=0.5, refresh_gap=0.2,
                       registry=registry) as scraper:
        picker.add_release_listener(scraper.refresh)
        await _until(lambda: first.requests == 1 and second.requests == 1)
        await asyncio.sleep(0.25)  # past the gap since the round's read
        taken = picker.load(first.endpoint).taken_at
        pick = picker.pick("llama", subset=frozenset({first.endpoint}))
        pick.lease.release()
        await _until(lambda: first.requests == 2)
        await _until(lambda: picker.load(first.endpoint).taken_at > taken)
        # Within the gap of that read, another ending reads nothing; the other endpoint was never read again.
        again = picker.pick("llama", subset=frozenset({first.endpoint}))
        again.lease.release()
        await asyncio.sleep(0.1)
        assert first.requests == 2 and second.requests == 1
        assert registry.get_sample_value("modeldock_scrape_refreshes_total", {"outcome": "ok"}) == 1
    # Stopped: an ending reads nothing.
    late = picker.pick("llama", subset=frozenset({first.endpoint}))
    await asyncio.sleep(0.25)
    late.lease.release()
    await asyncio.sleep(0.1)
    assert first.requests == 2


async def test_reads_out_of_turn_are_off_with_no_gap(servers: list[FakeVllm]) -> None:
    first, *_ = servers
    picker = Picker(SystemClock())
    picker.set_endpoints("llama", [first.endpoint], served_name=MODEL)
    async with Scraper(picker, SystemClock(), interval=30.0, timeout=0.3, budget=0.5) as scraper:
        picker.add_release_listener(scraper.refresh)
        await _until(lambda: first.requests == 1)
        await asyncio.sleep(0.05)
        picker.pick("llama").lease.release()
        await asyncio.sleep(0.1)
        assert first.requests == 1


async def _until(condition: object, timeout: float = 3.0) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def _token_page(blocks: int, tokens: int) -> str:
    return (f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 4\n'
            f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0\n'
            f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{blocks}"}} 1.0\n'
            f'vllm:prompt_tokens_total{{engine="0",model_name="{MODEL}"}} {tokens // 2}\n'
            f'vllm:generation_tokens_total{{engine="0",model_name="{MODEL}"}} {tokens - tokens // 2}\n')


async def test_capacity_is_read_rarely_and_speed_from_the_counters(servers: list[FakeVllm]) -> None:
    fake = servers[0]
    fake.page = _token_page(100, 0)
    clock = SystemClock()
    picker = Picker(clock)
    picker.set_endpoints("llama", [fake.endpoint], served_name=MODEL)
    scraper = Scraper(picker, clock, capacity_every=3)
    try:
        await scraper.scrape_once()
        assert picker.signals(fake.endpoint).capacity == 1600
        await asyncio.sleep(0.2)
        fake.page = _token_page(200, 1000)  # a restart with a bigger cache, and tokens flowing
        await scraper.scrape_once()
        signals = picker.signals(fake.endpoint)
        assert signals.capacity == 1600  # not read again yet
        assert 1000 / 0.6 < signals.speed < 1000 / 0.19  # ~1000 tokens over ~0.2 s
        await scraper.scrape_once()
        await scraper.scrape_once()
        assert picker.signals(fake.endpoint).capacity == 3200  # read again after `capacity_every` rounds
    finally:
        await scraper.stop()
