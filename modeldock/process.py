"""Run a long-lived service until SIGINT/SIGTERM, with optional Prometheus metrics."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, start_http_server


async def run_until_signalled(
    start: Callable[[], Awaitable[None]],
    stop: Callable[[], Awaitable[None]],
    *,
    registry: CollectorRegistry,
    host: str,
    metrics_port: int | None,
) -> None:
    if metrics_port is not None:
        start_http_server(metrics_port, addr=host, registry=registry)
    await start()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    await stop()
