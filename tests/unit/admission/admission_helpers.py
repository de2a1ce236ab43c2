"""Small builders shared by the admission tests."""

from __future__ import annotations

from typing import Any

from modeldock.config import Config, LimitsConfig, ModelConfig, TenantConfig, hash_key


def tenant(
    tenant_id: str = "acme",
    *,
    rpm: int = 0,
    per_model: dict[str, int] | None = None,
    max_in_flight: int = 0,
    **fields: Any,
) -> TenantConfig:
    """A tenant allowed every model, its API key `key-<id>`; `fields`: any other TenantConfig field
    (the token budgets' tests build theirs on this)."""
    return TenantConfig(
        id=tenant_id,
        api_key_hashes=[hash_key(f"key-{tenant_id}")],
        models=["*"],
        requests_per_minute=rpm,
        requests_per_minute_per_model=per_model or {},
        max_in_flight=max_in_flight,
        **fields,
    )


# Models the tests name; "big-alias" is a public alias served as "big", "llama-8b" is served as "meta/llama-8b".
MODELS = (
    ModelConfig(name="m", endpoints=["127.0.0.1:8000"]),
    ModelConfig(name="big", endpoints=["127.0.0.1:8001"]),
    ModelConfig(name="big-alias", served_name="big", endpoints=["127.0.0.1:8001"]),
    ModelConfig(name="small", endpoints=["127.0.0.1:8002"]),
    ModelConfig(name="other", endpoints=["127.0.0.1:8003"]),
    ModelConfig(name="llama-8b", served_name="meta/llama-8b", endpoints=["127.0.0.1:8004"]),
    ModelConfig(name="fast", served_name="meta/llama-8b", endpoints=["127.0.0.1:8004"]),
)


def config(*tenants: TenantConfig, **limits: Any) -> Config:
    return Config(tenants=list(tenants), models=list(MODELS), limits=LimitsConfig(**limits))
