"""Fixtures for the bench tests: an in-process fake OpenAI server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from bench_fake_server import FakeOpenAI, Script


@pytest.fixture
async def start_server() -> AsyncIterator[Callable[..., Awaitable[FakeOpenAI]]]:
    """Returns an async function that starts a FakeOpenAI with a given script."""
    runners: list[web.AppRunner] = []

    async def start(script: Script | None = None) -> FakeOpenAI:
        server = FakeOpenAI(script)
        # Cancel handlers whose client went away, so a stalled one cannot outlive the test.
        runner = web.AppRunner(server.app(), handler_cancellation=True, shutdown_timeout=1.0)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        server.base_url = f"http://{host}:{port}/v1"
        return server

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def fake_openai(start_server: Callable[..., Awaitable[FakeOpenAI]]) -> FakeOpenAI:
    return await start_server()
