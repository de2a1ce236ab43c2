"""The one Redis client factory for the request limits and the token budgets, and their failure vocabulary.

Below both rooms (`modeldock.admission`, `modeldock.budgets`): every Redis client of the gateway is made
by `make_redis_client`, every Redis failure they see is a `RedisUnavailable`, and an outage is logged
through a `LogThrottle`. Two shapes of client, because the two rooms talk to Redis two ways:

- the default (`batch=False`), for redis-py script calls (the request windows): a blocking pool of
  `MAX_CONNECTIONS`, every step (pool wait, connect, read) bounded by `timeout_s`;
- `batch=True`, for one `budgets.redis_batch.RedisBatch`, which holds one connection and bounds every
  write and read with `asyncio.timeout` itself: a small plain pool and no `socket_timeout` (with one
  set, redis-py wraps every send in `asyncio.wait_for`, a task per write). Connecting is bounded.

Both retry once at once, which reconnects a pooled connection that died with a restarted server: the
scripts sent through them are idempotent (a request id counts once, a settlement is absolute).

A `redis+sentinel://` URL (`SentinelUrl`) gives either shape on redis-py's `SentinelConnectionPool`
(`Sentinel.master_for`): each new connection asks the Sentinels for the master first, and a connection
to a master that was demoted turns its READONLY reply into a ConnectionError (redis-py's
`SentinelManagedConnection`), so the same retry reconnects, to the new master. During a failover the
Sentinels name no master (or a dead one): every call fails fast, a `RedisUnavailable` like a Redis
down, and the first call after the promotion connects to the new master. The Sentinels themselves are
asked with `timeout_s` on every step, and closed with the client.

With `cluster=True` (`limits.redis_cluster`) a redis:// or rediss:// URL names one node of a Redis Cluster
and either shape is a `redis.asyncio.RedisCluster` (typed as `Redis`: the callers use only what both
have, `register_script`, `pubsub`, `aclose`; `RedisBatch` finds the slot map on it). redis-py sends a
script call to the master of its first key's slot and follows MOVED and ASK; every script's keys share
one `{tenant}` hash tag, so one slot. Its pool is per node (`MAX_CONNECTIONS` each, not blocking: a
call beyond that fails at once). A connection error asks for a slot-map refresh (at most one a second)
and retries once, so a master that died fails its slots' calls until its replica is promoted and the
first refresh after that finds it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qsl, unquote, urlsplit

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedSSLConnection
from redis.backoff import NoBackoff

from modeldock.clock import Clock
from modeldock.redis_auth import RedisAuthConfig, ServerNameSSLConnection, connection_kwargs

__all__ = [
    "CLUSTER_HINT", "MAX_CONNECTIONS", "SENTINEL_PORT", "SENTINEL_SCHEME", "LogThrottle", "RedisClientFactory",
    "RedisUnavailable", "SENTINEL_TLS_SCHEME", "SentinelUrl", "cluster_hint",
    "is_sentinel_url", "make_batch_client", "make_client_factory",
    "make_redis_client", "parse_sentinel_url",
]

MAX_CONNECTIONS = 64  # the script-call pool's size
BATCH_CONNECTIONS = 4  # a batcher holds one; the rest cover a reconnect while the old one closes

# (redis_url, timeout in seconds) -> client. Tests pass their own.
RedisClientFactory = Callable[[str, float], Redis]


class RedisUnavailable(Exception):
    """Redis could not answer in time; the message says why (never the URL)."""

    def __init__(self, why: str) -> None:
        super().__init__(why + cluster_hint(why))


# A standalone client's calls to a cluster node: the node answers MOVED for the slots it does not
# serve (and CROSSSLOT), which would read as an outage with no clue; say what to set.
_CLUSTER_REPLIES = ("MovedError:", "AskError:", "CROSSSLOT", "MOVED ")
CLUSTER_HINT = " (a Redis Cluster node answered: set limits.redis_cluster: true)"


def cluster_hint(why: str) -> str:
    return CLUSTER_HINT if any(mark in why for mark in _CLUSTER_REPLIES) else ""


def make_redis_client(url: str, timeout_s: float, *, batch: bool = False, cluster: bool = False,
                      auth: RedisAuthConfig | None = None) -> Redis:
    """A client for script calls (every step bounded by `timeout_s`), or with `batch` for one batcher;
    `cluster`: a Redis Cluster client, found from the node the URL names; `auth`: credentials read at each
    new connection and TLS options (redis_auth.py)."""
    extra = connection_kwargs(auth, url)
    if cluster:
        return _cluster_client(url, timeout_s, batch, extra)
    if is_sentinel_url(url):
        return _sentinel_client(parse_sentinel_url(url), timeout_s, batch, extra)
    if batch:
        pool: ConnectionPool = ConnectionPool.from_url(
            url,
            **extra,
            max_connections=BATCH_CONNECTIONS,
            socket_timeout=None,  # redis-py's default is 5 s; the batcher bounds each write and read
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
    else:
        pool = BlockingConnectionPool.from_url(
            url,
            **extra,
            max_connections=MAX_CONNECTIONS,
            timeout=timeout_s,  # waiting for a free pooled connection
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
    return Redis.from_pool(pool)


def _sentinel_client(url: SentinelUrl, timeout_s: float, batch: bool, extra: dict[str, Any]) -> Redis:
    """`make_redis_client`'s two shapes on the master the Sentinels name."""
    # The TLS options (redis_auth.connection_kwargs) apply to the Sentinels and the master alike; the
    # master's password does not (the Sentinels have their own, in the URL's query).
    tls = {key: value for key, value in extra.items() if key.startswith("ssl_")}
    sentinel = Sentinel(
        url.sentinels,
        sentinel_kwargs={
            # Asked on every connect, before the master is: bounded even for the batcher (no task per send:
            # the Sentinels are not written to per call).
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "username": url.sentinel_username,
            "password": url.sentinel_password,
            **(_sentinel_tls(tls) if url.tls else {}),
        },
    )
    common: dict[str, Any] = {
        "db": url.db,
        "username": url.username,
        "password": url.password,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 1),
        **extra,  # a credential provider (the master's password from a file) replaces the URL's
    }
    if "credential_provider" in extra:
        del common["username"], common["password"]
    if url.tls:
        common.pop("connection_class", None)
        common["ssl"] = True  # SentinelConnectionPool then makes SentinelManagedSSLConnection ...
        if "ssl_server_name" in common:  # ... or ours, which also checks the configured name
            common["connection_class"] = _SentinelServerNameSSLConnection
    if batch:
        shape: dict[str, Any] = {"max_connections": BATCH_CONNECTIONS, "socket_timeout": None}
        pool_class: type[SentinelConnectionPool] = _SentinelPool
    else:
        shape = {"max_connections": MAX_CONNECTIONS, "timeout": timeout_s, "socket_timeout": timeout_s}
        pool_class = _BlockingSentinelPool
    return cast(Redis, sentinel.master_for(url.master, connection_pool_class=pool_class, **common, **shape))


def _cluster_client(url: str, timeout_s: float, batch: bool, extra: dict[str, Any]) -> Redis:
    """`make_redis_client`'s two shapes on a Redis Cluster (the URL is one node of it; db 0 only)."""
    client = RedisCluster.from_url(
        url,
        **extra,
        max_connections=BATCH_CONNECTIONS if batch else MAX_CONNECTIONS,  # per node
        socket_timeout=None if batch else timeout_s,  # the batcher bounds each write and read itself
        socket_connect_timeout=timeout_s,
        # One retry after a connection error, on a refreshed slot map; no backoff sleep inside a call
        # bounded by timeout_s.
        retry=Retry(NoBackoff(), 1),
        # A slot whose master is gone is refused (RedisUnavailable) while the others still answer.
        require_full_coverage=False,
    )
    return cast(Redis, client)


def make_client_factory(*, batch: bool, cluster: bool, auth: RedisAuthConfig | None = None) -> RedisClientFactory:
    """`make_redis_client` of one shape and topology, as a `RedisClientFactory` (the config's:
    `limits.redis_cluster`, `limits.redis_auth`)."""

    def factory(url: str, timeout_s: float) -> Redis:
        return make_redis_client(url, timeout_s, batch=batch, cluster=cluster, auth=auth)

    return factory


class _SentinelServerNameSSLConnection(SentinelManagedSSLConnection, ServerNameSSLConnection):
    """A Sentinel-managed TLS connection to the master that checks `ssl_server_name` (the Sentinels name
    the master by address)."""


def _sentinel_tls(tls: dict[str, Any]) -> dict[str, Any]:
    """The kwargs of a client of a Sentinel itself over TLS. redis-py makes those clients itself, with no
    connection class of ours, so a Sentinel's certificate is checked against the host in the URL (the
    configured server name applies to the master, which the Sentinels name by address)."""
    return {"ssl": True, **{key: value for key, value in tls.items() if key != "ssl_server_name"}}


class _SentinelPool(SentinelConnectionPool):
    """redis-py's pool on a Sentinel-named master, which also closes the Sentinels' clients when closed
    (redis-py leaves them to the caller; here nobody else holds them)."""

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            await self.sentinel_manager.aclose()


class _BlockingSentinelPool(_SentinelPool, BlockingConnectionPool):
    """The script-call shape: a caller waits up to `timeout` for a free connection (BlockingConnectionPool's
    get_connection and release), the connections are Sentinel-managed (SentinelConnectionPool's)."""


def make_batch_client(url: str, timeout_s: float) -> Redis:
    """`make_redis_client(url, timeout_s, batch=True)`, as a `RedisClientFactory`."""
    return make_redis_client(url, timeout_s, batch=True)


class LogThrottle:
    """True at most once per interval, so an outage logs a line, not a flood."""

    def __init__(self, clock: Clock, interval_s: float) -> None:
        self._clock = clock
        self._interval_s = interval_s
        self._last: float | None = None

    def ready(self) -> bool:
        now = self._clock.monotonic()
        if self._last is not None and now - self._last < self._interval_s:
            return False
        self._last = now
        return True


SENTINEL_SCHEME = "redis+sentinel"
SENTINEL_TLS_SCHEME = "rediss+sentinel"  # TLS to the Sentinels and to the master


def is_sentinel_url(url: str) -> bool:
    return url.lower().startswith((SENTINEL_SCHEME + "://", SENTINEL_TLS_SCHEME + "://"))

SENTINEL_PORT = 26379
SENTINEL_FORM = "redis+sentinel://[user[:password]@]host[:port][,host[:port]...]/<master-name>[/<db>]"
_ENCODE_HINT = " (an @ : / ? # or , in a password must be percent-encoded)"
_QUERY_KEYS = ("sentinel_username", "sentinel_password")


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed `redis+sentinel://` URL. `username`/`password` are the master's (and its replicas'),
    the `sentinel_*` ones the Sentinels' own (query parameters; None: the Sentinels take no AUTH)."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: bool = False  # rediss+sentinel://: the Sentinels and the master are spoken to over TLS

    def __repr__(self) -> str:  # never the passwords
        return f"SentinelUrl(sentinels={self.sentinels!r}, master={self.master!r}, db={self.db}, tls={self.tls})"


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The URL's parts, or ValueError saying what is wrong; the message never quotes the URL."""
    try:
        parts = urlsplit(url)
    except ValueError:
        raise ValueError(f"a {SENTINEL_SCHEME}:// URL that does not parse; the form is {SENTINEL_FORM}"
                         + _ENCODE_HINT) from None
    if parts.scheme not in (SENTINEL_SCHEME, SENTINEL_TLS_SCHEME):
        raise ValueError(f"must start with {SENTINEL_SCHEME}:// (or {SENTINEL_TLS_SCHEME}:// for TLS)")
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon and secret else None
    sentinels = tuple(_sentinel_address(item, i, hostlist.count(",") + 1)
                      for i, item in enumerate(hostlist.split(","), 1)) if hostlist else ()
    if not sentinels:
        raise ValueError(f"a {SENTINEL_SCHEME}:// URL needs at least one Sentinel host ({SENTINEL_FORM})")
    path = [unquote(segment) for segment in parts.path.split("/")[1:]]
    if len(path) > 1 and path[-1] == "":
        path.pop()  # a trailing slash
    if not path or not path[0]:
        raise ValueError(f"a {SENTINEL_SCHEME}:// URL needs the master's name after the hosts "
                         "(the name the Sentinels monitor: .../mymaster or .../mymaster/0)")
    if len(path) > 2:
        raise ValueError(f"a {SENTINEL_SCHEME}:// URL's path is /<master-name>[/<db>], nothing more")
    if len(path) == 2 and not path[1].isdigit():
        raise ValueError("the database after the master's name must be a number (.../mymaster/0)")
    db = int(path[1]) if len(path) == 2 else 0
    query: dict[str, str] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key not in _QUERY_KEYS:
            shown = f" {key!r}" if re.fullmatch(r"[A-Za-z_]{1,32}", key) else " (not shown)"
            raise ValueError(f"a {SENTINEL_SCHEME}:// URL takes only the query parameters "
                             f"{' and '.join(_QUERY_KEYS)}; not{shown}")
        query[key] = value
    return SentinelUrl(sentinels, path[0], db, username, password,
                       query.get("sentinel_username") or None, query.get("sentinel_password") or None,
                       tls=parts.scheme == SENTINEL_TLS_SCHEME)


def _sentinel_address(item: str, index: int, count: int) -> tuple[str, int]:
    which = f"Sentinel address {index} of {count}"
    if item.startswith("["):  # [IPv6] or [IPv6]:port
        host, bracket, rest = item[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"{which}: an IPv6 host is written [addr] or [addr]:port" + _ENCODE_HINT)
        port_text = rest[1:] if rest else None
    else:
        host, colon, port_text_or_empty = item.rpartition(":") if ":" in item else (item, "", "")
        port_text = port_text_or_empty if colon else None
    if not host:
        raise ValueError(f"{which} has no host (host[:port], the port defaults to {SENTINEL_PORT})" + _ENCODE_HINT)
    if port_text is None:
        return host, SENTINEL_PORT
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise ValueError(f"{which}: the port must be a number 1-65535" + _ENCODE_HINT)
    return host, int(port_text)
