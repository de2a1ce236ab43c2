"""Cancellation on client disconnect, injected faults and the slow knob."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from conftest import StartSim
from sim_helpers import get_json, post_json, wait_for

from modeldock.sim import Simulator

CHAT = "/v1/chat/completions"


def chat_body(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


async def stats(http: aiohttp.ClientSession, sim: Simulator) -> dict[str, Any]:
    result: dict[str, Any] = await get_json(http, sim, "/sim/stats")
    return result


async def test_disconnect_mid_stream_frees_the_request_at_once(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(step_base_ms=20.0, speed=1.0)  # 50 tokens a second: the stream lasts 20 s
    resp = await http.post(sim.url + CHAT, json=chat_body(1000, stream=True))
    seen = 0
    async for line in resp.content:
        if line.startswith(b"data: "):
            seen += 1
            if seen == 3:
                break
    before = await stats(http, sim)
    assert before["running"] == 1 and before["cancelled"] == 0
    assert sim.engine.kv_usage > 0
    closed_at = time.monotonic()
    resp.close()  # drops the connection, as a client that goes away

    async def freed() -> bool:
        return (await stats(http, sim))["cancelled"] == 1

    await wait_for(freed, 2.0, "the engine to cancel the request")
    assert time.monotonic() - closed_at < 0.5
    after = await stats(http, sim)
    assert after["running"] == 0 and after["completed"] == 0
    assert after["last_cancel_latency_ms"] is not None and 0 <= after["last_cancel_latency_ms"] < 50
    assert sim.engine.kv_usage == 0.0
    async with http.get(sim.url + "/metrics") as m:
        text = await m.text()
    assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="demo-model"} 1.0' in text
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="demo-model"} 0.0' in text
    assert 'vllm:num_requests_running{engine="0",model_name="demo-model"} 0.0' in text


async def test_disconnect_while_queued_leaves_the_waiting_queue(
    start_sim: StartSim, http: aiohttp.ClientSession
) -> None:
    sim = await start_sim(max_num_seqs=1, step_base_ms=20.0, speed=1.0)
    busy = asyncio.create_task(http.post(sim.url + CHAT, json=chat_body(200)))
    queued = asyncio.create_task(http.post(sim.url + CHAT, json=chat_body(5)))

    async def one_waiting() -> bool:
        s = await stats(http, sim)
        return s["running"] == 1 and s["waiting"] == 1

    await wait_for(one_waiting, 2.0, "one running and one waiting")
    queued.cancel()

    async def left_queue() -> bool:
        s = await stats(http, sim)
        return s["waiting"] == 0 and s["cancelled"] == 1

    await wait_for(left_queue, 2.0, "the queued request to be cancelled")
    assert (await stats(http, sim))["running"] == 1
    busy.cancel()
    await wait_for(lambda: _cancelled(http, sim, 2), 2.0, "the running request to be cancelled")
    assert sim.engine.kv_usage == 0.0
    for task in (busy, queued):
        with pytest.raises(asyncio.CancelledError):
            await task


async def _cancelled(http: aiohttp.ClientSession, sim: Simulator, n: int) -> bool:
    return (await stats(http, sim))["cancelled"] == n


async def test_status_503_for_the_next_count_requests(sim: Simulator, http: aiohttp.ClientSession) -> None:
    described = await post_json(http, sim, "/sim/fault", {"mode": "status_503", "count": 2})
    assert described == {"mode": "status_503", "chunks": 0, "count": 2}
    statuses = []
    for _ in range(3):
        async with http.post(sim.url + CHAT, json=chat_body(1, stream=True)) as resp:
            statuses.append(resp.status)
            if resp.status == 503:
                assert (await resp.json())["error"]["code"] == 503
    assert statuses == [503, 503, 200]
    assert (await get_json(http, sim, "/sim/fault"))["mode"] == "none"
    assert (await stats(http, sim))["received"] == 3


async def test_reset_before_headers_drops_the_connection(sim: Simulator, http: aiohttp.ClientSession) -> None:
    await post_json(http, sim, "/sim/fault", {"mode": "reset_before_headers", "count": 1})
    with pytest.raises(aiohttp.ClientError):
        async with http.post(sim.url + CHAT, json=chat_body(3)) as resp:
            await resp.read()
    async with http.post(sim.url + CHAT, json=chat_body(3)) as resp:
        assert resp.status == 200


async def test_die_after_chunks_cuts_the_stream(sim: Simulator, http: aiohttp.ClientSession) -> None:
    await post_json(http, sim, "/sim/fault", {"mode": "die_after_chunks", "chunks": 3, "count": None})
    for _ in range(2):  # count null: every request until reset
        events: list[bytes] = []
        with pytest.raises(aiohttp.ClientPayloadError):
            async with http.post(sim.url + CHAT, json=chat_body(1000, stream=True)) as resp:
                assert resp.status == 200
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        events.append(line)
        assert len(events) == 3  # role chunk + two tokens, then nothing, no [DONE]
        assert b"[DONE]" not in b"".join(events)
    await wait_for(lambda: _cancelled(http, sim, 2), 2.0, "the cut streams to leave the engine")
    await post_json(http, sim, "/sim/fault", {"mode": "none"})
    async with http.post(sim.url + CHAT, json=chat_body(3, stream=True)) as resp:
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")


async def test_die_after_more_chunks_than_the_stream_has_still_skips_done(
    sim: Simulator, http: aiohttp.ClientSession
) -> None:
    await post_json(http, sim, "/sim/fault", {"mode": "die_after_chunks", "chunks": 50, "count": 1})
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(sim.url + CHAT, json=chat_body(2, stream=True)) as resp:
            async for line in resp.content:
                received += line
    assert received.count(b"data: ") == 3 and b"[DONE]" not in received


async def test_fault_requests_are_validated(sim: Simulator, http: aiohttp.ClientSession) -> None:
    for bad in ({"mode": "explode"}, {"mode": "die_after_chunks", "chunks": -1}, {"mode": "status_503", "count": "x"}):
        async with http.post(sim.url + "/sim/fault", json=bad) as resp:
            assert resp.status == 400
    async with http.post(sim.url + "/sim/slow", json={"extra_step_ms": -1}) as resp:
        assert resp.status == 400


async def test_slow_knob_builds_a_queue(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(max_num_seqs=2, speed=100.0)
    await post_json(http, sim, "/sim/slow", {"extra_step_ms": 30})
    tasks = [asyncio.create_task(http.post(sim.url + CHAT, json=chat_body(5))) for _ in range(5)]

    async def queued() -> bool:
        s = await stats(http, sim)
        return s["running"] == 2 and s["waiting"] == 3

    started = time.monotonic()
    await wait_for(queued, 2.0, "two running and three waiting")
    responses = await asyncio.gather(*tasks)
    # Three waves of five 30 ms steps.
    assert time.monotonic() - started > 0.3
    for resp in responses:
        assert resp.status == 200
        resp.release()
    await post_json(http, sim, "/sim/slow", {"extra_step_ms": 0})
    started = time.monotonic()
    async with http.post(sim.url + CHAT, json=chat_body(5)) as resp:
        assert resp.status == 200
    assert time.monotonic() - started < 0.1


async def test_stop_cuts_open_requests_and_returns_quickly(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(step_base_ms=20.0, speed=1.0)
    resp = await http.post(sim.url + CHAT, json=chat_body(1000, stream=True))
    assert (await resp.content.readline()).startswith(b"data: ")
    queued = asyncio.create_task(http.post(sim.url + CHAT, json=chat_body(1000)))
    await wait_for(lambda: _running(sim, 2), 2.0, "both requests in the engine")
    started = time.monotonic()
    await sim.stop()
    assert time.monotonic() - started < 1.0
    with pytest.raises(aiohttp.ClientError):
        await resp.read()
    with pytest.raises(aiohttp.ClientError):
        await queued
    resp.close()


async def _running(sim: Simulator, n: int) -> bool:
    return sim.engine.num_running == n
