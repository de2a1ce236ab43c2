"""Start and stop a simulator inside the current event loop."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from aiohttp import web

from modeldock.clock import Clock, SystemClock
from modeldock.sim.app import SimApp
from modeldock.sim.config import SimConfig

# Streams still open at stop() are cut first, so this only bounds stragglers.
SHUTDOWN_TIMEOUT_S = 2.0


class Simulator:
    """A running simulator: where it listens, its parts (for tests), and stop()."""

    def __init__(self, app: SimApp, runner: web.AppRunner, host: str, port: int) -> None:
        self.app = app
        self.config = app.config
        self.engine = app.engine
        self.host = host
        self.port = port
        self._runner = runner
        self._stopped = False

    @property
    def url(self) -> str:
        """Base URL; the OpenAI API lives under url + "/v1"."""
        return f"http://{self.host}:{self.port}"

    def stats(self) -> dict[str, Any]:
        """What GET /sim/stats answers."""
        return self.app.stats()

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self.app.driver.stop()  # wakes every open request so its handler ends
        await self._runner.cleanup()

    async def __aenter__(self) -> Simulator:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


async def start_simulator(config: SimConfig | None = None, *, clock: Clock | None = None) -> Simulator:
    """Listen on config.host:config.port (0 picks a free port) and start the engine loop."""
    config = config or SimConfig()
    sim = SimApp(config, clock or SystemClock())
    # handler_cancellation: a client that disconnects cancels its handler at once, which
    # is how a queued or streaming request learns it must leave the engine.
    runner = web.AppRunner(
        sim.app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
    )
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    port = _bound_port(runner) or config.port
    sim.driver.start()
    return Simulator(sim, runner, config.host, port)


def _bound_port(runner: web.AppRunner) -> int | None:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    return None
