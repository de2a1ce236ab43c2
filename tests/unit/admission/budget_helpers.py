"""Builders for the token-budget tests."""

from __future__ import annotations

from typing import Any

from modeldock.config import Config, LimitsConfig, ModelConfig, PriceConfig, TenantConfig, hash_key


def budget_tenant(
    tenant_id: str = "acme", *, tpm: int = 0, tpd: int = 0, per_model: dict[str, int] | None = None,
    **fields: Any,
) -> TenantConfig:
    return TenantConfig(
        id=tenant_id,
        api_key_hashes=[hash_key(f"key-{tenant_id}")],
        models=["*"],
        tokens_per_minute=tpm,
        tokens_per_day=tpd,
        tokens_per_minute_per_model=per_model or {},
        **fields,
    )


def budget_config(*tenants: TenantConfig, price: PriceConfig | None = None, **limits: Any) -> Config:
    return Config(
        tenants=list(tenants),
        # Every per-model budget key must match some served name (config validation).
        models=[ModelConfig(name=name, endpoints=["127.0.0.1:8000"], price=price)
                for name in ("m", "llama-8b", "llama-70b")],
        limits=LimitsConfig(**limits),
    )
