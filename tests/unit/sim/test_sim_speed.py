"""Speed: a half-speed backend from the start (--speed 0.5) or changed while running (/sim/speed)."""

from __future__ import annotations

import argparse
import time

import aiohttp
from conftest import StartSim
from sim_helpers import post_json

from modeldock.sim.cli import add_arguments, config_from_args

CHAT = "/v1/chat/completions"
BODY = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}


async def timed(http: aiohttp.ClientSession, url: str) -> float:
    started = time.monotonic()
    async with http.post(url + CHAT, json=BODY) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
    return time.monotonic() - started


def test_cli_takes_a_fractional_speed() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--speed", "0.5"])).speed == 0.5


async def test_speed_changes_while_running(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    # 20 tokens, ~20 steps of 10 ms of simulated time: 2 ms at speed 100, >= 100 ms at speed 2.
    sim = await start_sim(step_base_ms=10.0, speed=100.0)
    fast = await timed(http, sim.url)
    assert await post_json(http, sim, "/sim/speed", {"speed": 2}) == {"speed": 2}
    slow = await timed(http, sim.url)
    assert slow >= 0.1 and slow > 5 * fast
    for bad in (0, -1, True, "2", None):
        async with http.post(sim.url + "/sim/speed", json={"speed": bad}) as resp:
            assert resp.status == 400
