"""Fixtures the e2e tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.access_log import AccessLogCollector, access_log_server


@pytest.fixture
async def access_log() -> AsyncIterator[tuple[AccessLogCollector, int]]:
    """An access-log collector served on its own loopback port: (collector, port), stopped after the test."""
    async with access_log_server() as served:
        yield served
