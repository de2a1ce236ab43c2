"""Builders for the token-budget tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis.asyncio

from modeldock.clock import FakeClock
from modeldock.config import Config, LimitsConfig, ModelConfig, PriceConfig, TenantConfig
from tests.support.redis_server import RedisServer
from tests.unit.admission.admission_helpers import tenant


def budget_tenant(
    tenant_id: str = "acme", *, tpm: int = 0, tpd: int = 0, per_model: dict[str, int] | None = None,
    **fields: Any,
) -> TenantConfig:
    return tenant(tenant_id, tokens_per_minute=tpm, tokens_per_day=tpd,
                  tokens_per_minute_per_model=per_model or {}, **fields)


def budget_config(*tenants: TenantConfig, price: PriceConfig | None = None, **limits: Any) -> Config:
    return Config(
        tenants=list(tenants),
        # Every per-model budget key must match some served name (config validation).
        models=[ModelConfig(name=name, endpoints=["127.0.0.1:8000"], price=price)
                for name in ("m", "llama-8b", "llama-70b")],
        limits=LimitsConfig(**limits),
    )


MINUTE = "modeldock:tb:{acme}:minute"


def clocked(clock: FakeClock) -> Callable[[], int]:
    return lambda: round(clock.time() * 1_000_000)


async def redis_total(server: RedisServer, key: str = MINUTE) -> int:
    client = redis.asyncio.Redis.from_url(server.url, decode_responses=True)
    try:
        return int(await client.hget(key + ":amt", "~total") or 0)
    finally:
        await client.aclose()
