"""The HTTP side: the OpenAI SDK against a started simulator, SSE framing and timing."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

import aiohttp
import openai
import pytest
from conftest import StartSim
from sim_helpers import get_json

from modeldock.sim import Simulator
from modeldock.sim.tokens import render_chat, reply_text, text_prompt


def client(sim: Simulator) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="sk-test", max_retries=0)


async def test_chat_non_streaming_with_the_openai_sdk(sim: Simulator) -> None:
    messages: list[Any] = [{"role": "user", "content": "Hello there"}]
    async with client(sim) as c:
        reply = await c.chat.completions.create(model="demo-model", messages=messages, max_tokens=5)
    prompt = text_prompt(render_chat(messages), 16)
    assert reply.model == "demo-model" and reply.id.startswith("chatcmpl-")
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == reply_text(prompt.seed, 5)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt.num_tokens, 5)
    assert reply.usage.total_tokens == prompt.num_tokens + 5


async def test_chat_streaming_with_usage_with_the_openai_sdk(sim: Simulator) -> None:
    async with client(sim) as c:
        stream = await c.chat.completions.create(
            model="demo-model",
            messages=[{"role": "user", "content": "Count"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    tokens = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(tokens) == 6
    assert [c.choices[0].finish_reason for c in tokens] == [None] * 5 + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert len({c.id for c in chunks}) == 1


async def test_completions_default_length_ends_with_stop(sim: Simulator) -> None:
    async with client(sim) as c:
        whole = await c.completions.create(model="demo-model", prompt="Once upon a time")
        pieces = [chunk async for chunk in await c.completions.create(model="demo-model", prompt="Once upon a time",
                                                                      stream=True)]
    assert whole.usage is not None and whole.usage.completion_tokens == 16
    assert whole.choices[0].finish_reason == "stop"
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "stop"


async def test_sse_framing_is_exactly_vllms(sim: Simulator, http: aiohttp.ClientSession) -> None:
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
    async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        raw = (await resp.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert len(payloads) == 4  # role chunk + 3 tokens; no usage chunk unless asked
    assert all("usage" not in p for p in payloads)


async def test_chunks_arrive_one_by_one_while_generating(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    # 20 ms per step in real time: 10 tokens take ~200 ms, so buffering would show.
    sim = await start_sim(step_base_ms=20.0, speed=1.0)
    body = {"model": "demo-model", "prompt": "tick", "max_tokens": 10, "stream": True}
    arrivals: list[float] = []
    started = time.perf_counter()
    async with http.post(sim.url + "/v1/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                arrivals.append(time.perf_counter() - started)
    assert len(arrivals) == 10
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert arrivals[-1] - arrivals[0] > 0.15, f"all chunks within {arrivals[-1] - arrivals[0]:.3f}s"
    assert sum(gap > 0.01 for gap in gaps) >= 8, gaps


async def test_errors_look_like_vllms(sim: Simulator, http: aiohttp.ClientSession) -> None:
    async with http.post(sim.url + "/v1/chat/completions",
                         json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"] == {
            "message": "The model `nope` does not exist.", "type": "NotFoundError", "param": None, "code": 404,
        }
    async with http.post(sim.url + "/v1/chat/completions", data=b"{not json",
                         headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["type"] == "BadRequestError"
    async with http.post(sim.url + "/v1/completions", json={"prompt": "x" * 40_000}) as resp:
        assert resp.status == 400
        assert "maximum context length" in (await resp.json())["error"]["message"]
    async with client(sim) as c:
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


async def test_models_health_and_request_log(sim: Simulator, http: aiohttp.ClientSession) -> None:
    models = await get_json(http, sim, "/v1/models")
    assert [m["id"] for m in models["data"]] == ["demo-model"]
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 200
    body = {"model": "demo-model", "prompt": "hi", "max_tokens": 1}
    headers = [("Authorization", "Bearer secret"), ("X-Dup", "one"), ("X-Dup", "two")]
    async with http.post(sim.url + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200
    log = await get_json(http, sim, "/sim/requests")
    # /health is a probe and is not logged; the models call and the completion are, in order.
    assert [(e["method"], e["path"]) for e in log] == [("GET", "/v1/models"), ("POST", "/v1/completions")]
    last = log[-1]
    assert last["body"] == body
    assert ["Authorization", "Bearer secret"] in last["headers"]
    assert [v for k, v in last["headers"] if k == "X-Dup"] == ["one", "two"]
    async with http.delete(sim.url + "/sim/requests") as resp:
        assert resp.status == 200
    assert await get_json(http, sim, "/sim/requests") == []


async def test_request_log_keeps_the_last_hundred(sim: Simulator, http: aiohttp.ClientSession) -> None:
    for i in range(105):
        async with http.get(sim.url + "/v1/models", params={"i": str(i)}) as resp:
            assert resp.status == 200
    log = await get_json(http, sim, "/sim/requests")
    assert len(log) == 100
    assert log[0]["query"] == "i=5" and log[-1]["query"] == "i=104"


async def test_two_simulators_in_one_process_are_independent(start_sim: StartSim,
                                                             http: aiohttp.ClientSession) -> None:
    started = time.perf_counter()
    a = await start_sim(model="a")
    b = await start_sim(model="b")
    assert time.perf_counter() - started < 1.0
    async with client(a) as c:
        await c.completions.create(model="a", prompt="x", max_tokens=2)
    async with http.get(b.url + "/metrics") as resp:
        text = await resp.text()
    assert 'vllm:generation_tokens_total{engine="0",model_name="b"} 0.0' in text
    assert (await get_json(http, a, "/sim/stats"))["completed"] == 1
    assert (await get_json(http, b, "/sim/stats"))["completed"] == 0


async def test_a_thousand_concurrent_streams(start_sim: StartSim) -> None:
    sim = await start_sim(speed=50.0)
    body = {"model": "demo-model", "prompt": "go", "max_tokens": 4, "stream": True}

    async def one(session: aiohttp.ClientSession) -> int:
        async with session.post(sim.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            raw = await resp.read()
        assert raw.endswith(b"data: [DONE]\n\n")
        return raw.count(b'"text":')

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        counts = await asyncio.wait_for(asyncio.gather(*(one(session) for _ in range(1000))), timeout=60)
    assert counts == [4] * 1000
    stats = sim.stats()
    assert stats["completed"] == 1000 and stats["running"] == 0 and stats["waiting"] == 0
    assert stats["kv_cache_usage"] == 0.0


async def test_api_key_is_required_like_vllm(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(api_key="sk-backend")
    body = {"model": sim.app.config.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-backend"}):
        async with http.post(f"{sim.url}/v1/chat/completions", json=body, headers=headers) as resp:
            assert resp.status == 401 and await resp.json() == {"error": "Unauthorized"}
    async with http.post(f"{sim.url}/v1/chat/completions", json=body,
                         headers={"Authorization": "Bearer sk-backend"}) as resp:
        assert resp.status == 200 and (await resp.json())["choices"]
    async with http.get(f"{sim.url}/health") as resp:  # probes need no key, as with vLLM
        assert resp.status == 200
    # The request log shows what the backend received, refused requests included.
    seen = [dict(e["headers"]).get("Authorization") for e in sim.app.requests.entries()]
    assert seen == [None, "Bearer wrong", "sk-backend", "Bearer sk-backend"]
