"""KV capacity and token rate, read from a running simulator's real /metrics text."""

from __future__ import annotations

import aiohttp
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from modeldock.flowcontrol import (
    CounterReading,
    kv_capacity_tokens,
    read_counters,
    token_rate,
)
from modeldock.sim import SimConfig, start_simulator


async def scrape(http: aiohttp.ClientSession, url: str) -> list[Metric]:
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        return list(text_string_to_metric_families(await resp.text()))


async def test_capacity_and_token_rate_from_simulator_metrics() -> None:
    config = SimConfig(model="m", num_gpu_blocks=1000, block_size=32, max_model_len=4096, speed=50.0)
    async with await start_simulator(config) as sim, aiohttp.ClientSession() as http:
        before = await scrape(http, sim.url)
        assert kv_capacity_tokens(before) == 32_000
        first = read_counters(before, "m", at=10.0)
        assert first == CounterReading(at=10.0, prompt_tokens=0.0, generation_tokens=0.0)
        body = {"model": "m", "prompt": "a" * 400, "max_tokens": 20}
        async with http.post(sim.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
        after = await scrape(http, sim.url)
        second = read_counters(after, "m", at=12.0)
        assert second is not None
        assert second.prompt_tokens == 100 and second.generation_tokens == 20
        rate = token_rate(first, second)
        assert rate is not None
        assert rate.prompt_per_second == 50.0 and rate.generation_per_second == 10.0 and rate.total_per_second == 60.0
        assert read_counters(after, "another-model", at=12.0) is None  # only series of another model


def test_pages_that_do_not_say() -> None:
    text = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None",engine="0"} 1.0\n'
    assert kv_capacity_tokens(text_string_to_metric_families(text)) is None
    assert read_counters(text_string_to_metric_families(text), None, at=0.0) is None
    two_engines = (
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="100",engine="0"} 1.0\n'
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="50",engine="1"} 1.0\n'
    )
    assert kv_capacity_tokens(text_string_to_metric_families(two_engines)) == 2400


def test_rate_needs_time_and_growing_counters() -> None:
    a = CounterReading(at=5.0, prompt_tokens=100, generation_tokens=100)
    assert token_rate(a, a) is None
    assert token_rate(a, CounterReading(at=6.0, prompt_tokens=10, generation_tokens=200)) is None  # restarted
