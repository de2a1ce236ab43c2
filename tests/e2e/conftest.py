"""Fixtures the e2e tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from tests.support.access_log import AccessLogCollector, access_log_server
from tests.support.stack import Stack, wait_until


@pytest.fixture
async def access_log() -> AsyncIterator[tuple[AccessLogCollector, int]]:
    """An access-log collector served on its own loopback port: (collector, port), stopped after the test."""
    async with access_log_server() as served:
        yield served


@pytest.fixture
def no_leaked_in_flight(stack: Stack) -> Iterator[None]:
    """After each test, the module's `stack` counts nothing in flight again within 5 s (a module takes it with
    `pytest.mark.usefixtures("no_leaked_in_flight")`)."""
    yield
    wait_until(lambda: stack.in_flight() == 0, 5, what="in-flight count back to 0")
