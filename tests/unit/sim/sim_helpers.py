"""Helpers shared by the simulator tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

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
