"""TLS and credentials to a real Redis: `limits.redis_auth` through the gateway's own client factory.

A test CA (tests/support/tls_ca.py) signs a server certificate for 127.0.0.1 and redis.test, and a client
certificate; a redis-server listens only over TLS. Passwords come from a file or a variable, read at each
new connection, so a rotation needs no restart; no secret reaches a repr, a log or an error.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from modeldock.admission.limits import Admission
from modeldock.clock import SystemClock
from modeldock.config import ConfigError, parse_config
from modeldock.errors import Unavailable
from modeldock.redis_auth import PasswordProvider, RedisAuthConfig, connection_kwargs
from modeldock.redis_client import make_redis_client
from tests.support.redis_server import RedisServer
from tests.support.tls_ca import Issued, RedisTLS, TestCA
from tests.unit.admission.admission_helpers import config, tenant

pytestmark = pytest.mark.timeout(60)

PW1, PW2 = "first-s3cret-pw", "second-s3cret-pw"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def server_cert(ca: TestCA) -> Issued:
    return ca.issue("server", dns=["redis.test"], ips=["127.0.0.1"])


@pytest.fixture(scope="module")
def client_cert(ca: TestCA) -> Issued:
    return ca.issue("client", client=True)


@pytest.fixture(scope="module")
def tls_redis(ca: TestCA, server_cert: Issued) -> Iterator[RedisTLS]:
    with RedisTLS(ca, server_cert) as server:
        yield server


async def _ping(url: str, auth: RedisAuthConfig | None) -> bool:
    client = make_redis_client(url, 2.0, auth=auth)
    try:
        return bool(await client.ping())
    finally:
        await client.aclose()


def test_rediss_with_the_ca_connects_and_another_ca_does_not(tls_redis: RedisTLS, ca: TestCA,
                                                             tmp_path: Path) -> None:
    assert asyncio.run(_ping(tls_redis.url, RedisAuthConfig(tls_ca_file=ca.cert)))
    other = TestCA(tmp_path, name="another CA")
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        asyncio.run(_ping(tls_redis.url, RedisAuthConfig(tls_ca_file=other.cert)))


def test_the_server_name_is_checked_and_tls_server_name_replaces_the_host(tls_redis: RedisTLS, ca: TestCA,
                                                                          tmp_path: Path) -> None:
    # A certificate for redis.test only, on a server dialled by IP: the name check fails...
    only_name = ca.issue("named", dns=["redis.test"])
    with RedisTLS(ca, only_name) as server:
        with pytest.raises(redis.ConnectionError, match="IP address mismatch|doesn't match|hostname"):
            asyncio.run(_ping(server.url, RedisAuthConfig(tls_ca_file=ca.cert)))
        # ...unless the name to check is given, and then only the right one passes.
        assert asyncio.run(_ping(server.url, RedisAuthConfig(tls_ca_file=ca.cert, tls_server_name="redis.test")))
        with pytest.raises(redis.ConnectionError, match="mismatch|doesn't match|hostname"):
            asyncio.run(_ping(server.url, RedisAuthConfig(tls_ca_file=ca.cert, tls_server_name="other.test")))


def test_a_client_certificate_is_sent_when_the_server_requires_one(ca: TestCA, server_cert: Issued,
                                                                   client_cert: Issued) -> None:
    with RedisTLS(ca, server_cert, require_client_cert=True) as server:
        with_cert = RedisAuthConfig(tls_ca_file=ca.cert, tls_cert_file=client_cert.cert, tls_key_file=client_cert.key)
        assert asyncio.run(_ping(server.url, with_cert))
        with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
            asyncio.run(_ping(server.url, RedisAuthConfig(tls_ca_file=ca.cert)))


class _AclRedis(RedisServer):
    """Only the ACL user `app` (password PW1) may log in; up once it answers PING with NOAUTH."""

    def __init__(self) -> None:
        super().__init__(args=("--user", "default", "off", "--user", "app", "on", f">{PW1}", "~*", "&*", "+@all"))

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False


def _acl_server() -> RedisServer:
    return _AclRedis()


def test_a_rotated_password_file_takes_effect_at_the_next_connection_without_a_restart(tmp_path: Path) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text(PW1 + "\n")  # the trailing newline of `echo pw > file` is not part of it
    auth = RedisAuthConfig(username="app", password_file=secret)
    with _acl_server() as server:

        async def rotate() -> None:
            client = make_redis_client(server.url, 2.0, auth=auth)
            try:
                assert await client.set("k", "1")
                # The server's password changes, then the file (a Secret's symlink swap, a rewrite).
                admin = redis.Redis(port=server.port, username="app", password=PW1)
                admin.execute_command("ACL", "SETUSER", "app", "resetpass", f">{PW2}")
                admin.close()
                secret.write_text(PW2)
                await client.connection_pool.disconnect()  # the next call opens a new connection
                assert await client.get("k") == b"1"
            finally:
                await client.aclose()

        asyncio.run(rotate())
        # The old password no longer works: the new connection really logged in with the new one.
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, username="app", password=PW1).ping()


def test_a_password_from_a_variable_and_a_missing_one_fails_as_redis_unavailable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with _acl_server() as server:
        monkeypatch.setenv("MODELDOCK_TEST_REDIS_PW", PW1)
        env_auth = RedisAuthConfig(username="app", password_env="MODELDOCK_TEST_REDIS_PW")
        assert asyncio.run(_ping(server.url, env_auth))

        # Through admission: a variable gone empty fails closed as Redis down (a 503), naming the variable.
        monkeypatch.setenv("MODELDOCK_TEST_REDIS_PW", "")
        acme = tenant("acme", rpm=5)
        cfg = config(acme, redis_url=server.url, redis_auth=env_auth, redis_timeout_ms=2000)

        async def admit() -> Unavailable:
            admission = Admission(cfg, SystemClock())
            try:
                with pytest.raises(Unavailable) as info:
                    await admission.admit(acme, "m")
                return info.value
            finally:
                await admission.close()

        with caplog.at_level(logging.DEBUG):
            rejection = asyncio.run(admit())
        assert rejection.status == 503 and rejection.code == "rate_limiter_unavailable"
        assert "MODELDOCK_TEST_REDIS_PW" in caplog.text and "is empty or not set" in caplog.text
        assert PW1 not in caplog.text and PW1 not in str(rejection)


def test_no_secret_in_a_repr_or_an_error(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text(PW1)
    auth = RedisAuthConfig(username="app", password_file=secret)
    provider = connection_kwargs(auth, "redis://h:6379/0")["credential_provider"]
    assert isinstance(provider, PasswordProvider)
    assert provider.get_credentials() == ("app", PW1)
    client = make_redis_client("redis://127.0.0.1:1/0", 0.2, auth=auth)
    for text in (repr(provider), str(provider), repr(auth), repr(client), repr(client.connection_pool)):
        assert PW1 not in text
    asyncio.run(client.aclose())


@pytest.mark.parametrize(
    ("limits", "says"),
    [
        ({"redis_url": "redis://h/0", "redis_auth": {"tls_ca_file": "CA"}},
         "limits.redis_auth.tls_ca_file: TLS options need a rediss:// URL"),
        ({"redis_url": "rediss://h/0", "redis_auth": {"tls_cert_file": "CERT"}},
         "tls_key_file"),
        ({"redis_url": "rediss://h/0", "redis_auth": {"tls_ca_file": "/no/such/ca.pem"}},
         "no such file"),
        ({"redis_url": "redis://h/0", "redis_auth": {"password_file": "PW", "password_env": "X"}},
         "give one of password_file or password_env, not both"),
        ({"redis_url": f"redis://app:{PW1}@h/0", "redis_auth": {"password_env": "X"}},
         "limits.redis_auth.password_env: the Redis URL also holds a username or password"),
        ({"redis_url": "redis://h/0", "redis_auth": {"username": "app"}}, "needs a password"),
        ({"redis_url": "redis://h/0", "redis_auth": {"tls_servername": "x"}}, "tls_servername"),
    ],
)
def test_a_bad_redis_auth_names_the_field(tmp_path: Path, ca: TestCA, limits: dict[str, object], says: str) -> None:
    files = {"CA": str(ca.cert), "CERT": str(ca.cert), "PW": str(ca.cert)}
    auth = limits.get("redis_auth")
    if isinstance(auth, dict):
        limits = {**limits, "redis_auth": {k: files.get(v, v) if isinstance(v, str) else v for k, v in auth.items()}}
    data = {"models": [{"name": "m", "endpoints": ["10.0.0.1:8000"]}], "limits": limits}
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert says in str(info.value)
    assert PW1 not in str(info.value)
