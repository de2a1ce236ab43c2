"""`limits.redis_auth` on a real Redis Cluster: every node's connection logs in with the password file's
current contents (the default user is off, so nothing else could get in), and a rotation reaches new
connections without a restart."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from modeldock.devstack.redis_cluster import RedisClusterTopology
from modeldock.redis_auth import RedisAuthConfig
from modeldock.redis_client import make_redis_client

pytestmark = pytest.mark.timeout(90)


def _acl(topology: RedisClusterTopology, *commands: tuple[str, ...], login: tuple[str, str] | None = None) -> None:
    for node in topology.nodes:
        client = redis.Redis(port=node.port, username=login[0] if login else None,
                             password=login[1] if login else None, socket_timeout=5)
        try:
            for command in commands:
                client.execute_command(*command)
        finally:
            client.close()


def test_the_cluster_client_logs_in_on_every_node_and_follows_a_rotation(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("pw-one\n")
    auth = RedisAuthConfig(username="app", password_file=secret)
    with RedisClusterTopology() as topology:
        keys = [f"k{{tenant-{i}}}" for i in range(24)]  # tags spread over all three masters
        assert len({topology.master_of(key).port for key in keys}) == 3
        _acl(topology, ("ACL", "SETUSER", "app", "on", ">pw-one", "~*", "&*", "+@all"),
             ("ACL", "SETUSER", "default", "off"))

        async def run() -> None:
            client = make_redis_client(topology.url, 2.0, cluster=True, auth=auth)
            try:
                for i, key in enumerate(keys):
                    assert await client.set(key, i)
                _acl(topology, ("ACL", "SETUSER", "app", "resetpass", ">pw-two"), login=("app", "pw-one"))
                secret.write_text("pw-two")
                fresh = make_redis_client(topology.url, 2.0, cluster=True, auth=auth)
                try:
                    assert [int(v) for v in [await fresh.get(key) for key in keys]] == list(range(len(keys)))
                finally:
                    await fresh.aclose()
            finally:
                await client.aclose()

        asyncio.run(run())
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=topology.nodes[0].port, username="app", password="pw-one").ping()
