"""Helpers shared by the simulator tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from modeldock.sim import Simulator


async def wait_for(predicate: Callable[[], Awaitable[bool]], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def get_json(http: aiohttp.ClientSession, sim: Simulator, path: str) -> Any:
    async with http.get(sim.url + path) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def post_json(http: aiohttp.ClientSession, sim: Simulator, path: str, body: Any) -> Any:
    async with http.post(sim.url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


LABELS = {"model_name": "demo-model", "engine": "0"}


async def scrape(http: aiohttp.ClientSession, sim: Simulator) -> dict[str, Any]:
    """Metric family name -> (type, {(sample name, sorted labels): value})."""
    async with http.get(sim.url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    families: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        families[family.name] = (family.type, samples)
    return families


def value(families: dict[str, Any], sample: str, **labels: str) -> float:
    family = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    key = (sample, tuple(sorted({**LABELS, **labels}.items())))
    return float(families[family][1][key])
