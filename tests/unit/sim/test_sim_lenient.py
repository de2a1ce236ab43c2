"""The simulator parses request fields as vLLM's lax pydantic models do, and serves n, best_of and prompt lists
as vLLM does: one engine sequence per (prompt, sample), choices numbered prompt-major, usage and metrics over all."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from conftest import StartSim
from sim_helpers import get_json, post_json, scrape, value, wait_for

from modeldock.sim.config import SimConfig
from modeldock.sim.protocol import parse_job
from modeldock.sim.tokens import text_prompt, token_ids_prompt

CONFIG = SimConfig(model="m", max_model_len=8192)
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(("raw", "parsed"), [(5000, 5000), (5000.0, 5000), ("5000", 5000), (" 5000 ", 5000),
                                             ("5000.0", 5000), ("1_000", 1000)])
@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_output_limits_accept_integral_floats_and_digit_strings(field: str, raw: Any, parsed: int) -> None:
    assert parse_job("chat", {"messages": MESSAGES, field: raw}, CONFIG).max_tokens == parsed
    if field == "max_tokens":
        assert parse_job("completion", {"prompt": "hi", field: raw}, CONFIG).max_tokens == parsed


@pytest.mark.parametrize("raw", [True, "true", "True", "1", 1, 1.0, "yes", "on", "t", "y"])
def test_stream_accepts_pydantic_lax_trues(raw: Any) -> None:
    assert parse_job("chat", {"messages": MESSAGES, "stream": raw}, CONFIG).stream is True


@pytest.mark.parametrize("raw", [False, "false", "0", 0, 0.0, "no", "off", None])
def test_stream_accepts_pydantic_lax_falses(raw: Any) -> None:
    assert parse_job("chat", {"messages": MESSAGES, "stream": raw}, CONFIG).stream is False


def test_n_best_of_and_seed_take_the_same_lax_ints() -> None:
    job = parse_job("chat", {"messages": MESSAGES, "n": "3", "best_of": 5.0, "seed": "7"}, CONFIG)
    assert job.n == 3 and len(job.choices) == 5
    assert [c.index for c in job.choices if c.returned] == [0, 1, 2]
    assert len(parse_job("chat", {"messages": MESSAGES, "n": 250, "max_tokens": 20}, CONFIG).choices) == 250


def test_a_prompt_list_is_one_prompt_per_entry() -> None:
    texts = ["a" * 40, "b" * 8, "c"]
    job = parse_job("completion", {"prompt": texts, "max_tokens": 2}, CONFIG)
    assert [p.num_tokens for p in job.prompts] == [10, 2, 1]
    assert job.prompt_tokens == 13
    ids = parse_job("completion", {"prompt": [[1, 2, 3], [4, 5]], "n": 2}, CONFIG)
    assert [p.num_tokens for p in ids.prompts] == [3, 2]
    assert [(c.index, c.prompt_index) for c in ids.choices] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    # pydantic's lax list[int] takes integral floats as token ids, as vLLM does.
    assert parse_job("completion", {"prompt": [1.0, 2.0]}, CONFIG).prompt == token_ids_prompt([1, 2], 16)


async def test_lenient_fields_reach_the_engine(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(model="m")
    body = {"model": "m", "messages": MESSAGES, "max_tokens": "7", "stream": "true",
            "stream_options": {"include_usage": True}}
    async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in (await resp.read()).split(b"\n\n") if line.startswith(b"data: {")]
    assert json.loads(events[-1][6:])["usage"]["completion_tokens"] == 7
    whole = await post_json(http, sim, "/v1/completions", {"prompt": "hi", "max_tokens": 9.0, "stream": "0"})
    assert whole["usage"]["completion_tokens"] == 9


async def test_n_choices_are_separate_sequences_with_usage_and_metrics_over_all(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim()
    prompt = text_prompt("<|user|>\nhello\n<|assistant|>\n", 16).num_tokens
    reply = await post_json(http, sim, "/v1/chat/completions", {"messages": MESSAGES, "n": 3, "max_tokens": 5})
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in reply["choices"]}) == 3  # each its own sample
    assert reply["usage"] == {"prompt_tokens": prompt, "completion_tokens": 15, "total_tokens": prompt + 15}
    families = await scrape(http, sim)
    assert value(families, "vllm:generation_tokens_total") == 15
    assert value(families, "vllm:prompt_tokens_total") == 3 * prompt  # every sequence prefills its prompt
    assert value(families, "vllm:request_success_total", finished_reason="length") == 3
    assert (await get_json(http, sim, "/sim/stats"))["completed"] == 3


async def test_a_prompt_list_with_n_streams_choices_numbered_as_vllm(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    # No max_tokens: each prompt's output is the default (16, "stop") cut to what its context leaves,
    # so the prompts' choices differ in length and show which prompt each index belongs to.
    sim = await start_sim(max_model_len=64, num_gpu_blocks=64)
    long, short = "x" * 200, "y" * 8  # 50 tokens (14 left: "length") and 2 tokens (16: "stop")
    body = {"prompt": [long, short], "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    texts: dict[int, int] = {}
    reasons: dict[int, str] = {}
    usage: dict[str, int] = {}
    async with http.post(sim.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        raw = await asyncio.wait_for(resp.read(), 10)
    assert raw.endswith(b"data: [DONE]\n\n")
    for event in raw.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        chunk = json.loads(event[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], 0) + 1
            if choice["finish_reason"]:
                reasons[choice["index"]] = choice["finish_reason"]
    assert texts == {0: 14, 1: 14, 2: 16, 3: 16}
    assert reasons == {0: "length", 1: "length", 2: "stop", 3: "stop"}
    assert usage == {"prompt_tokens": 52, "completion_tokens": 60, "total_tokens": 112}
    families = await scrape(http, sim)
    assert value(families, "vllm:generation_tokens_total") == 60
    assert value(families, "vllm:prompt_tokens_total") == 2 * 50 + 2 * 2


async def test_best_of_generates_every_sample_and_returns_n(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim()
    reply = await post_json(http, sim, "/v1/completions", {"prompt": "hello", "n": 1, "best_of": 3, "max_tokens": 4})
    assert [c["index"] for c in reply["choices"]] == [0]
    assert reply["usage"]["completion_tokens"] == 4  # vLLM's usage counts the returned outputs
    assert value(await scrape(http, sim), "vllm:generation_tokens_total") == 12  # the engine made all three


async def test_the_samples_share_the_batch_and_all_leave_when_the_client_does(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(step_base_ms=20.0, speed=1.0)  # 50 steps a second: 1000 tokens outlast the test
    resp = await http.post(sim.url + "/v1/completions", json={"prompt": ["a", "b"], "n": 2, "max_tokens": 1000,
                                                              "stream": True})
    async for line in resp.content:
        if line.startswith(b"data: "):
            break
    assert sim.engine.num_running == 4 and sim.engine.kv_usage > 0
    resp.close()

    async def freed() -> bool:
        return bool((await get_json(http, sim, "/sim/stats"))["cancelled"] == 4)

    await wait_for(freed, 2.0, "the engine to drop all four sequences")
    assert sim.engine.num_running == 0 and sim.engine.kv_usage == 0.0
