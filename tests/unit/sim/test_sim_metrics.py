"""/metrics: vLLM's names and labels, with values that match the engine."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from conftest import StartSim
from sim_helpers import get_json, scrape, value, wait_for

from modeldock.sim import Simulator
from modeldock.sim.tokens import text_prompt


async def test_vllm_metric_names_types_and_labels(sim: Simulator, http: aiohttp.ClientSession) -> None:
    families = await scrape(http, sim)
    expected = {
        "vllm:num_requests_running": "gauge",
        "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:time_per_output_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:cache_config_info": "gauge",
    }
    for name, kind in expected.items():
        assert name in families, name
        assert families[name][0] == kind, name
    assert value(families, "vllm:prefix_cache_queries_total") == 0.0
    for reason in ("stop", "length", "abort"):
        assert value(families, "vllm:request_success_total", finished_reason=reason) == 0.0
    ((_, labels), info), = families["vllm:cache_config_info"][1].items()
    assert info == 1.0
    wanted = {"block_size": "16", "num_gpu_blocks": "4096", "enable_prefix_caching": "True", "engine": "0"}
    assert wanted.items() <= dict(labels).items()
    ttft = families["vllm:time_to_first_token_seconds"][1]
    ttft_buckets = [dict(labels)["le"] for name, labels in ttft if name.endswith("_bucket")]
    assert ttft_buckets[:3] == ["0.001", "0.005", "0.01"] and ttft_buckets[-1] == "+Inf"


async def test_gauges_follow_the_engine_under_load(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(max_num_seqs=2, step_base_ms=20.0, speed=1.0)
    body = {"model": "demo-model", "prompt": "a long story " * 30, "max_tokens": 1000, "stream": True}

    async def stream() -> None:
        async with http.post(sim.url + "/v1/completions", json=body) as resp:
            async for _ in resp.content:
                pass

    tasks = [asyncio.create_task(stream()) for _ in range(5)]

    async def loaded() -> bool:
        s = await get_json(http, sim, "/sim/stats")
        return s["running"] == 2 and s["waiting"] == 3

    await wait_for(loaded, 2.0, "two running and three waiting")
    families = await scrape(http, sim)
    assert value(families, "vllm:num_requests_running") == 2
    assert value(families, "vllm:num_requests_waiting") == 3
    usage = value(families, "vllm:kv_cache_usage_perc")
    # Two ~100-token sequences hold 7 blocks each of the 4096.
    assert 0 < usage < 0.01
    assert abs(usage - sim.engine.kv_usage) < 3 / 4096  # at most a step's growth apart

    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    async def drained() -> bool:
        return (await get_json(http, sim, "/sim/stats"))["cancelled"] == 5

    await wait_for(drained, 2.0, "all five to be cancelled")
    families = await scrape(http, sim)
    assert value(families, "vllm:num_requests_running") == 0
    assert value(families, "vllm:num_requests_waiting") == 0
    assert value(families, "vllm:kv_cache_usage_perc") == 0.0
    assert value(families, "vllm:request_success_total", finished_reason="abort") == 5


async def test_counters_and_latency_histograms_after_requests(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(step_base_ms=10.0, speed=1.0)
    prompts = ["one", "two two two", "three " * 10]
    for prompt in prompts:
        body = {"model": "demo-model", "prompt": prompt, "max_tokens": 4}
        async with http.post(sim.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
    families = await scrape(http, sim)
    assert value(families, "vllm:generation_tokens_total") == 12
    assert value(families, "vllm:prompt_tokens_total") == sum(text_prompt(p, 16).num_tokens for p in prompts)
    assert value(families, "vllm:request_success_total", finished_reason="length") == 3
    assert value(families, "vllm:time_to_first_token_seconds_count") == 3
    assert value(families, "vllm:inter_token_latency_seconds_count") == 9
    assert value(families, "vllm:time_per_output_token_seconds_count") == 9
    assert value(families, "vllm:e2e_request_latency_seconds_count") == 3
    # Wall-clock durations: at least one 10 ms step to the first token, four steps in all.
    assert value(families, "vllm:time_to_first_token_seconds_sum") >= 3 * 0.009
    assert value(families, "vllm:e2e_request_latency_seconds_sum") >= 3 * 0.036
    assert value(families, "vllm:inter_token_latency_seconds_sum") >= 9 * 0.009


async def test_prefix_cache_counters_count_shared_prompts(sim: Simulator, http: aiohttp.ClientSession) -> None:
    prompt = "shared context " * 40
    for _ in range(2):
        body = {"model": "demo-model", "prompt": prompt, "max_tokens": 1}
        async with http.post(sim.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
    tokens = text_prompt(prompt, 16).num_tokens  # 150 tokens: 9 full blocks
    families = await scrape(http, sim)
    assert value(families, "vllm:prefix_cache_queries_total") == 2 * tokens
    assert value(families, "vllm:prefix_cache_hits_total") == 9 * 16


async def test_preemptions_are_counted_and_requests_still_finish(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    # 8 blocks of 16 tokens; two sequences growing to ~104 tokens cannot both fit.
    sim = await start_sim(num_gpu_blocks=8, max_model_len=128, speed=50.0)
    body = {"model": "demo-model", "prompt": "abcdefghijklmnop", "max_tokens": 100}

    async def one() -> Any:
        async with http.post(sim.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            return await resp.json()

    replies = await asyncio.gather(one(), one())
    assert [r["usage"]["completion_tokens"] for r in replies] == [100, 100]
    assert replies[0]["choices"][0]["text"] == replies[1]["choices"][0]["text"]
    families = await scrape(http, sim)
    assert value(families, "vllm:num_preemptions_total") == sim.engine.preemptions >= 1
