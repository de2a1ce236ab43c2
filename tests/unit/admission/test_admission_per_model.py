"""Per-model rate limits: keyed by the served name (aliases cannot dodge them), keys as globs,
the lowest matching limit binds, and keys that match nothing are config errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeldock.admission.limits import Admission
from modeldock.admission.per_model import ModelLimit, PerModelLimits, per_model_limits
from modeldock.clock import FakeClock
from modeldock.config import ConfigError, hash_key, parse_config
from modeldock.errors import RateLimited
from tests.support.redis_server import RedisServer
from tests.unit.admission.admission_helpers import MODELS, config, tenant


async def admitted(admission: Admission, t: object, model: str, n: int) -> int:
    """How many of n requests for `model` are admitted (each released at once)."""
    count = 0
    for _ in range(n):
        try:
            ticket = await admission.admit(t, model)  # type: ignore[arg-type]
        except RateLimited:
            continue
        ticket.release()
        count += 1
    return count


def test_tables_key_by_served_name() -> None:
    t = tenant(per_model={"big": 3, "fast": 5})
    table = per_model_limits(t, MODELS)
    # The alias of `big` gets big's limit and window; `fast` and `llama-8b` serve one name, so the key
    # naming the alias covers both (the lowest of the matching limits binds on a served name).
    assert table["big"] == table["big-alias"] == ModelLimit("big", 3)
    assert table["fast"] == table["llama-8b"] == ModelLimit("meta/llama-8b", 5)
    assert table["m"] == ModelLimit("m", 0) and table["small"] == ModelLimit("small", 0)


def test_globs_and_the_lowest_matching_limit() -> None:
    t = tenant(per_model={"*": 100, "meta/*": 10, "llama-8b": 7, "b?g": 50})
    table = per_model_limits(t, MODELS)
    assert table["m"].limit == 100 and table["other"].limit == 100
    assert table["llama-8b"] == table["fast"] == ModelLimit("meta/llama-8b", 7)  # matched by served name too
    assert table["big"].limit == table["big-alias"].limit == 50


def test_lookup_follows_the_tenant_object_and_handles_unknown_models() -> None:
    t = tenant(per_model={"big": 2})
    limits = PerModelLimits(config(t))
    assert limits.lookup(t, "big-alias") == ModelLimit("big", 2)
    changed = tenant(per_model={"big*": 4})  # same id, another config: rebuilt, not stale
    assert limits.lookup(changed, "big-alias") == ModelLimit("big", 4)
    assert limits.lookup(changed, "bigger-unknown") == ModelLimit("bigger-unknown", 4)
    assert limits.lookup(changed, "nope") == ModelLimit("nope", 0)


async def test_alias_shares_the_served_models_window() -> None:
    t = tenant(per_model={"big": 3})
    admission = Admission(config(t), FakeClock())
    assert await admitted(admission, t, "big", 2) == 2
    # Through the alias: one slot left, not a fresh window of 3.
    assert await admitted(admission, t, "big-alias", 5) == 1
    assert await admitted(admission, t, "big", 1) == 0
    with pytest.raises(RateLimited) as caught:
        await admission.admit(t, "big-alias")
    assert "on model big (requested as big-alias)" in caught.value.message
    # Models not covered by the key are not limited.
    assert await admitted(admission, t, "small", 10) == 10


async def test_glob_key_gives_each_served_model_its_own_window() -> None:
    t = tenant(per_model={"*": 2})
    admission = Admission(config(t), FakeClock())
    assert await admitted(admission, t, "m", 5) == 2
    assert await admitted(admission, t, "small", 5) == 2
    assert await admitted(admission, t, "llama-8b", 1) + await admitted(admission, t, "fast", 4) == 2


async def test_reload_applies_new_keys_and_keeps_the_counts() -> None:
    t = tenant(per_model={"big": 5})
    admission = Admission(config(t), FakeClock())
    assert await admitted(admission, t, "big-alias", 3) == 3
    lowered = tenant(per_model={"b*": 4})
    admission.reconfigure(config(lowered))
    assert await admitted(admission, lowered, "big", 5) == 1


def test_a_key_that_matches_no_model_is_a_config_error() -> None:
    def cfg(per_model: dict[str, int]) -> dict[str, object]:
        return {
            "tenants": [
                {"id": "ok", "api_key_hashes": [hash_key("k0")], "models": ["*"]},
                {"id": "acme", "api_key_hashes": [hash_key("k1")], "models": ["*"],
                 "requests_per_minute_per_model": per_model},
            ],
            "models": [{"name": "llama", "served_name": "meta/llama", "endpoints": ["127.0.0.1:1"]}],
        }

    for bad in ({"x": 1}, {"llama": 1, "mistral-*": 2}, {"Llama": 1}):
        with pytest.raises(ConfigError) as caught:
            parse_config(cfg(bad), "gw.yaml")
        key = next(k for k in bad if k not in ("llama",))
        assert str(caught.value) == f"gw.yaml: tenants[1].requests_per_minute_per_model: {key!r} matches no model"
    for good in ({"llama": 1}, {"meta/llama": 1}, {"l*": 1}, {"meta/*": 1, "*": 9}):
        parse_config(cfg(good))


async def test_alias_cannot_dodge_the_shared_redis_window(redis_server: RedisServer) -> None:
    t = tenant(per_model={"meta/llama-8b": 4})
    cfg = config(t, redis_url=redis_server.url, redis_timeout_ms=2000)
    a, b = Admission(cfg, FakeClock()), Admission(cfg, FakeClock())
    try:
        # Two replicas, two public names, one served model: 4 in total.
        got = await admitted(a, t, "llama-8b", 2) + await admitted(b, t, "fast", 3)
        got += await admitted(a, t, "fast", 2) + await admitted(b, t, "llama-8b", 2)
        assert got == 4
        import redis as redis_lib

        client = redis_lib.Redis.from_url(redis_server.url)
        try:
            names = sorted(k.decode() for k in client.keys("*"))
        finally:
            client.close()
        assert names == ["modeldock:rl:{acme}:model:meta/llama-8b"]
    finally:
        await a.close()
        await b.close()


def test_config_check_names_the_field_of_a_key_that_matches_no_model(tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    data = {
        "tenants": [{"id": "acme", "api_key_hashes": [hash_key("k")], "models": ["*"],
                     "requests_per_minute_per_model": {"llama-*": 5, "x": 1}}],
        "models": [{"name": "llama-8b", "endpoints": ["127.0.0.1:1"]}],
    }
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump(data))
    run = subprocess.run([sys.executable, "-m", "modeldock", "config", "check", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert f"{path}: tenants[0].requests_per_minute_per_model: 'x' matches no model" in run.stderr + run.stdout
    del data["tenants"][0]["requests_per_minute_per_model"]["x"]
    path.write_text(yaml.safe_dump(data))
    run = subprocess.run([sys.executable, "-m", "modeldock", "config", "check", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
