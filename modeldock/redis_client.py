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
"""

from __future__ import annotations

from collections.abc import Callable

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from modeldock.clock import Clock

__all__ = [
    "MAX_CONNECTIONS", "LogThrottle", "RedisClientFactory", "RedisUnavailable",
    "make_batch_client", "make_redis_client",
]

MAX_CONNECTIONS = 64  # the script-call pool's size
BATCH_CONNECTIONS = 4  # a batcher holds one; the rest cover a reconnect while the old one closes

# (redis_url, timeout in seconds) -> client. Tests pass their own.
RedisClientFactory = Callable[[str, float], Redis]


class RedisUnavailable(Exception):
    """Redis could not answer in time; the message says why (never the URL)."""


def make_redis_client(url: str, timeout_s: float, *, batch: bool = False) -> Redis:
    """A client for script calls (every step bounded by `timeout_s`), or with `batch` for one batcher."""
    if batch:
        pool: ConnectionPool = ConnectionPool.from_url(
            url,
            max_connections=BATCH_CONNECTIONS,
            socket_timeout=None,  # redis-py's default is 5 s; the batcher bounds each write and read
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
    else:
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=timeout_s,  # waiting for a free pooled connection
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
    return Redis.from_pool(pool)


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
