"""Fixtures for the flow-control tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest


@pytest.fixture
def idle_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop that is never run: enough to own the futures of synchronous tests."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
