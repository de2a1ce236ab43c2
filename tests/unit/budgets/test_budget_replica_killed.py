"""A replica killed (SIGKILL) while calendar and cost counters hold its reservations in Redis.

What it held stands, at what it reserved, until its period ends: a request whose usage nobody will report
is charged its reservation (the settlement rule), and a token lease stands at its grant. So budgets never
under-count, and the survivor keeps exact arithmetic on top. Bounded: the dead replica's open requests
plus at most one lease per budget set (1/16 of the smallest limit). A real process on a real Redis.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from modeldock.budgets.budgets import TokenBudgets
from modeldock.budgets.headers import format_money
from modeldock.budgets.pricing import Price, model_price
from modeldock.budgets.tokens import Usage
from modeldock.clock import SystemClock
from modeldock.config import Config, PriceConfig
from tests.support.redis_server import RedisServer
from tests.unit.budgets.budget_helpers import budget_config, budget_tenant, redis_total

ROOT = Path(__file__).resolve().parents[3]
PRICE = PriceConfig(input=2.0, output=8.0)
MONTH_LIMIT = 160_000  # leases up to 10,000 (1/16)

# The doomed replica: a monthly token budget (drawn through a lease) and a cost budget (reserved per
# request), one open request each; it says which keys hold them, then waits to be killed.
CHILD = """
import asyncio, sys
import redis.asyncio
from modeldock.budgets.headers import format_money
from modeldock.budgets.budgets import TokenBudgets
from modeldock.budgets.pricing import model_price
from modeldock.clock import SystemClock
from tests.unit.budgets.test_budget_replica_killed import config

async def main() -> None:
    cfg = config(sys.argv[1])
    budgets = TokenBudgets(cfg, SystemClock())
    months, costs = cfg.tenants
    await budgets.reserve(months, "m", "dead-1", prompt=1000, output=500)
    await budgets.reserve(costs, "m", "dead-2", prompt=1000, output=500, price=model_price(cfg.models[0]))
    client = redis.asyncio.Redis.from_url(sys.argv[1], decode_responses=True)
    keys = sorted(await client.keys("modeldock:tb:*:amt"))
    print("held", *keys, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def config(url: str) -> Config:
    months = budget_tenant("months", tokens_per_month=MONTH_LIMIT)
    costs = budget_tenant("costs", cost_per_month=1.0)
    return budget_config(months, costs, price=PRICE, redis_url=url, redis_timeout_ms=2000)


@pytest.mark.timeout(30)
async def test_a_killed_replicas_reservations_stand_and_the_survivor_counts_exactly(
        redis_server: RedisServer) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD, redis_server.url], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 20)  # type: ignore[union-attr]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert line.startswith("held"), line
    keys = [k.removesuffix(":amt") for k in line.split()[1:]]
    month = next(k for k in keys if "{months}:month:" in k)
    cost = next(k for k in keys if "{costs}:cost:month:" in k)
    ceiling = 2000 + 500 * 8  # Price.ceiling in millionths: 1000 x 2 + 500 x 8
    lease = await redis_total(redis_server, month)
    assert 1500 <= lease <= MONTH_LIMIT // 16  # the lease it drew the request from stands at its grant
    assert await redis_total(redis_server, cost) == ceiling  # the open request stands at its reservation

    cfg = config(redis_server.url)
    months, costs = cfg.tenants
    price = model_price(cfg.models[0])
    assert price == Price(2.0, 8.0)
    survivor = TokenBudgets(cfg, SystemClock())
    async with asyncio.timeout(15):
        try:
            r = await survivor.reserve(costs, "m", "live-1", prompt=1000, output=500, price=price)
            # Its remaining counts the dead replica's reservation: 1,000,000 - two ceilings.
            assert r.headers["x-ratelimit-remaining-cost"] == format_money(1_000_000 - 2 * ceiling)
            await r.finish(sent=True, usage=Usage(1000, 100))  # 2,000 + 800
            await survivor.flush()
            assert await redis_total(redis_server, cost) == ceiling + 2800
            m = await survivor.reserve(months, "m", "live-2", prompt=1000, output=500)
            await m.finish(sent=True, usage=Usage(900, 50))
            await survivor.close()  # retires its own lease: what it holds becomes what it charged
            assert await redis_total(redis_server, month) == lease + 950
        finally:
            await survivor.close()
