"""Fixtures that start in-process simulators and check nothing is left running after."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from modeldock.sim import SimConfig, Simulator, start_simulator

StartSim = Callable[..., Awaitable[Simulator]]


@pytest.fixture
async def start_sim() -> AsyncIterator[StartSim]:
    """start_sim(**SimConfig fields) -> a running simulator, stopped after the test."""
    started: list[Simulator] = []

    async def start(**fields: Any) -> Simulator:
        fields.setdefault("speed", 20.0)
        sim = await start_simulator(SimConfig(**fields))
        started.append(sim)
        return sim

    yield start
    for sim in started:
        await sim.stop()
    current = asyncio.current_task()
    leftovers: list[asyncio.Task[Any]] = []
    for _ in range(50):  # client-side finalizers (closing async generators) need a few loop turns
        await asyncio.sleep(0.01)
        leftovers = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        if not leftovers:
            break
    assert not leftovers, f"tasks left running: {leftovers}"


@pytest.fixture
async def sim(start_sim: StartSim) -> Simulator:
    return await start_sim()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        yield session
