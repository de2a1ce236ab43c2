"""Fixtures of the token-budget tests: the test's clock and timers, and replicas on the test's Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from modeldock.budgets.budgets import TokenBudgets
from modeldock.clock import FakeClock
from tests.support.manual_timers import ManualTimers
from tests.support.redis_server import RedisServer
from tests.unit.budgets.budget_helpers import budget_config, budget_tenant, clocked

__all__ = ["Replicas", "clock", "replicas", "timers"]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def timers() -> ManualTimers:
    return ManualTimers()


class Replicas:
    """Makes `TokenBudgets` replicas of one tenant ("acme") on the test's Redis, Redis's TIME read from
    the test's clock. Every replica made is closed at teardown (close is idempotent: a test that checks
    what close leaves behind closes it itself first)."""

    def __init__(self, server: RedisServer, clock: FakeClock) -> None:
        self.server = server
        self.clock = clock
        self.made: list[TokenBudgets] = []

    def __call__(
        self,
        tpm: int = 0,
        *,
        lease_ms: int | None = None,
        timeout_ms: int = 2000,
        fail_open: bool = False,
        timers: ManualTimers | None = None,
    ) -> TokenBudgets:
        """`lease_ms` None: the default lease lifetime (0: every request reserved in Redis on its own);
        `timers`: the settlement flush and lease timers fired by hand, else the event loop's."""
        leases = {} if lease_ms is None else {"token_lease_ms": lease_ms}
        cfg = budget_config(
            budget_tenant(tpm=tpm),
            redis_url=self.server.url,
            redis_timeout_ms=timeout_ms,
            redis_fail_open=fail_open,
            **leases,
        )
        budgets = TokenBudgets(cfg, self.clock, redis_now_us=clocked(self.clock),
                               redis_call_later=None if timers is None else timers.call_later)
        self.made.append(budgets)
        return budgets


@pytest_asyncio.fixture
async def replicas(redis_server: RedisServer, clock: FakeClock) -> AsyncIterator[Replicas]:
    made = Replicas(redis_server, clock)
    try:
        yield made
    finally:
        # A test that paused or stopped Redis: each close flushes what is queued, so give it a Redis.
        redis_server.resume()
        if not redis_server.running:
            redis_server.start()
        for budgets in made.made:
            await budgets.close()  # each flush bounded by the replica's redis_timeout_ms
