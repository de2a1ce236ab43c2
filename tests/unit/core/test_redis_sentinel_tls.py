"""`rediss+sentinel://`: TLS to the Sentinels and to the master they name, on a real Sentinel topology that
speaks TLS only (replication and the Sentinels' own links too), through the gateway's client factory."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from modeldock.config import ConfigError, parse_config
from modeldock.devstack.redis_sentinel import RedisSentinel, TLSFiles
from modeldock.redis_auth import RedisAuthConfig
from modeldock.redis_client import make_redis_client, parse_sentinel_url
from tests.support.tls_ca import TestCA

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("sentinel-ca"))


@pytest.fixture(scope="module")
def topology(ca: TestCA) -> Iterator[RedisSentinel]:
    server = ca.issue("sentinel-node", ips=["127.0.0.1"])
    with RedisSentinel(tls=TLSFiles(ca.cert, server.cert, server.key)) as running:
        yield running


def test_the_url_says_tls() -> None:
    assert parse_sentinel_url("rediss+sentinel://s1/m").tls
    assert not parse_sentinel_url("redis+sentinel://s1/m").tls


def test_the_master_is_reached_over_tls_with_the_ca_and_not_without(topology: RedisSentinel, ca: TestCA,
                                                                    tmp_path: Path) -> None:
    assert topology.url.startswith("rediss+sentinel://")

    async def write(auth: RedisAuthConfig | None) -> bytes | None:
        client = make_redis_client(topology.url, 2.0, auth=auth)
        try:
            await client.set("tls-key", "1")
            return await client.get("tls-key")
        finally:
            await client.aclose()

    assert asyncio.run(write(RedisAuthConfig(tls_ca_file=ca.cert))) == b"1"
    # Another CA (and the system's, with no tls_ca_file): the certificates do not verify.
    other = TestCA(tmp_path, name="other CA")
    for auth in (RedisAuthConfig(tls_ca_file=other.cert), None):
        with pytest.raises(redis.ConnectionError):  # MasterNotFoundError is one: no Sentinel verified
            asyncio.run(write(auth))


def test_a_failover_over_tls_reaches_the_promoted_master_without_a_restart(topology: RedisSentinel,
                                                                          ca: TestCA) -> None:
    async def run() -> float:
        client = make_redis_client(topology.url, 1.0, auth=RedisAuthConfig(tls_ca_file=ca.cert))
        try:
            assert await client.incr("count") >= 1
            topology.kill_master()
            killed_at = time.monotonic()
            deadline = killed_at + 30
            while True:
                try:
                    await client.incr("count")
                    return time.monotonic() - killed_at
                except (redis.RedisError, OSError):
                    assert time.monotonic() < deadline, "no promoted master answered over TLS"
                    await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    assert asyncio.run(run()) > 0
    promoted = topology.wait_for_failover(10.0)
    assert promoted.port != topology.killed[-1].port


@pytest.mark.parametrize(
    ("url", "problem"),
    [("redis+sentinel://s1/m", "limits.redis_auth.tls_ca_file: TLS options need a rediss+sentinel:// URL"),
     ("rediss+sentinel://s1,s2:26380/m/0", None)],
)
def test_tls_options_need_the_tls_form_of_the_url(ca: TestCA, url: str, problem: str | None) -> None:
    data = {"models": [{"name": "m", "endpoints": ["10.0.0.1:8000"]}],
            "limits": {"redis_url": url, "redis_auth": {"tls_ca_file": str(ca.cert)}}}
    if problem is None:
        assert parse_config(data).limits.redis_url == url
        return
    with pytest.raises(ConfigError, match=problem.replace(".", r"\.").replace("+", r"\+")):
        parse_config(data)
