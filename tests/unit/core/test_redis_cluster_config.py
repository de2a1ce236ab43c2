"""`limits.redis_cluster`: which URLs it takes (errors name the field and never quote the URL), the client
it makes, and the hint a standalone client's MOVED reply carries."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis, RedisCluster

from modeldock.config import ConfigError, parse_config, with_env_redis
from modeldock.redis_client import CLUSTER_HINT, RedisUnavailable, make_client_factory, make_redis_client

SECRET = "s3cr3t-cluster-pw"
MODELS = [{"name": "m", "endpoints": ["127.0.0.1:8000"]}]


def config(**limits: object) -> dict[str, object]:
    return {"models": MODELS, "limits": limits}


@pytest.mark.parametrize("url", [f"redis://:{SECRET}@10.0.0.1:6379", f"rediss://app:{SECRET}@node-1:6380/0",
                                 "redis://node-1"])
def test_a_cluster_takes_a_redis_or_rediss_url_of_one_node(url: str) -> None:
    parsed = parse_config(config(redis_url=url, redis_cluster=True))
    assert parsed.limits.redis_cluster and parsed.limits.redis_url == url


@pytest.mark.parametrize(("url", "says"), [
    (f"redis+sentinel://:{SECRET}@s1,s2/mymaster", "redis:// or rediss://"),
    ("unix:///run/redis.sock", "redis:// or rediss://"),
    (f"redis://:{SECRET}@10.0.0.1:6379/3", "database 0"),
])
def test_a_cluster_refuses_other_urls_naming_the_field(url: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(config(redis_url=url, redis_cluster=True), "gw.yaml")
    text = str(caught.value)
    assert "limits.redis_cluster" in text and says in text
    assert SECRET not in text and url not in text


def test_redis_url_from_the_environment_is_checked_against_the_flag() -> None:
    parsed = parse_config(config(redis_cluster=True))
    assert with_env_redis(parsed, {"REDIS_URL": "redis://n1:7000"}).limits.redis_url == "redis://n1:7000"
    with pytest.raises(ConfigError) as caught:
        with_env_redis(parsed, {"REDIS_URL": f"redis+sentinel://:{SECRET}@s1/m"})
    assert "$REDIS_URL" in str(caught.value) and "limits.redis_cluster" in str(caught.value)
    assert SECRET not in str(caught.value)


def test_off_by_default_and_any_url_without_it() -> None:
    parsed = parse_config(config(redis_url="unix:///run/redis.sock"))
    assert parsed.limits.redis_cluster is False


async def test_the_factory_makes_a_cluster_client_of_either_shape_only_with_the_flag() -> None:
    for batch in (False, True):
        client = make_client_factory(batch=batch, cluster=True)("redis://127.0.0.1:7000", 0.05)
        assert isinstance(client, RedisCluster)
        await client.aclose()
        plain = make_redis_client("redis://127.0.0.1:7000", 0.05, batch=batch)
        assert isinstance(plain, Redis)
        await plain.aclose()


def test_a_moved_reply_to_a_standalone_client_says_to_set_the_flag() -> None:
    assert str(RedisUnavailable("MovedError: 3999 10.0.0.2:6379")).endswith(CLUSTER_HINT)
    assert "limits.redis_cluster: true" in CLUSTER_HINT
    assert str(RedisUnavailable("ResponseError: CROSSSLOT Keys in request don't hash to the same slot")).endswith(
        CLUSTER_HINT)
    assert str(RedisUnavailable("no answer within 50 ms")) == "no answer within 50 ms"
