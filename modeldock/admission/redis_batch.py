"""Lua script calls to one Redis, sent together in non-transactional pipelines.

Each redis-py round trip costs ~100-200 µs of this process's CPU whatever it carries, so calls
that can share one do:

- `call` (the request path, e.g. a token reserve) is awaited. It is sent at once when no pipeline
  is in flight, so concurrency 1 waits for nothing; while one is in flight, later calls queue and
  all go in the next pipeline when it returns (at most about one round trip of waiting).
- `defer` (off the request path: settlements, refunds) rides with the next pipeline, or is sent
  `flush_interval_s` after it was queued, or at once when `max_batch` are queued.

Every item is its own EVALSHA (no MULTI): its own atomic script run and its own reply or error.
One pipeline is in flight at a time, so items reach Redis in the order they were queued (the
queued deferred ones first). A call is bounded by `timeout_s` from when it was made, its wait in
the queue included; every failure (refused, reset, timeout, error reply) is `RedisUnavailable`.
A call that times out or is cancelled after its pipeline was sent may still have run: undoing
it is the caller's job (e.g. a refund through `defer`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.connection import HiredisRespSerializer
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.utils import HIREDIS_AVAILABLE

from modeldock.admission.redis_window import RedisUnavailable

_hiredis = HiredisRespSerializer() if HIREDIS_AVAILABLE else None

FLUSH_INTERVAL_S = 0.01
MAX_BATCH = 64


def make_batch_client(url: str, timeout_s: float) -> Redis:
    """A client for one `RedisBatch`, which has one pipeline in flight and bounds each with
    `asyncio.timeout`: so a plain pool (a few connections) and no `socket_timeout` (with one set,
    redis-py wraps every send in `asyncio.wait_for`, a task per pipeline). Connecting is bounded."""
    pool = ConnectionPool.from_url(
        url,
        max_connections=4,
        socket_timeout=None,  # redis-py's default is 5 s
        socket_connect_timeout=timeout_s,
        # One immediate retry reconnects a pooled connection that died with a restarted server. The
        # budget scripts are idempotent (a reservation id counts once, a settlement is absolute).
        retry=Retry(NoBackoff(), 1),
    )
    return Redis.from_pool(pool)


class Handle(Protocol):
    def cancel(self) -> None: ...


# (delay seconds, callback) -> a handle to cancel it; `loop.call_later` unless a test injects one.
CallLater = Callable[[float, Callable[[], None]], Handle]
OnError = Callable[[RedisUnavailable], None]


class Script:
    """A Lua script known by its SHA1, loaded into Redis on first NOSCRIPT (e.g. after a restart)."""

    __slots__ = ("sha", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


class _Item:
    __slots__ = ("args", "future", "on_error", "script")

    def __init__(
        self, script: Script, args: list[Any], future: asyncio.Future[Any], on_error: OnError | None
    ) -> None:
        self.script = script
        self.args = args  # numkeys, keys, then the script's args: EVALSHA's arguments after the sha
        self.future = future
        self.on_error = on_error  # deferred items only: told of a failure, their future gets None


class RedisBatch:
    def __init__(
        self,
        client_factory: Callable[[], Redis],
        *,
        timeout_s: float,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        max_batch: int = MAX_BATCH,
        call_later: CallLater | None = None,
    ) -> None:
        self._client_factory = client_factory
        self._client: Redis | None = None
        self._conn: AbstractConnection | None = None
        self.timeout_s = timeout_s
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self._call_later = call_later
        self._calls: list[_Item] = []
        self._deferred: list[_Item] = []
        self._sender: asyncio.Task[None] | None = None
        self._timer: Handle | None = None
        self._flush_due = False
        self._closed = False
        self.pipelines = 0  # pipelines sent (for tests and benchmarks)

    async def call(self, script: Script, keys: Sequence[str], args: Sequence[int | str]) -> Any:
        """Run `script` and return its reply; RedisUnavailable if it fails or takes over `timeout_s`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._calls.append(_Item(script, [len(keys), *keys, *args], future, None))
        if self._sender is None:
            self._start(loop)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await future
        except TimeoutError:
            raise RedisUnavailable(f"no answer within {self.timeout_s * 1000:.0f} ms") from None

    def defer(
        self, script: Script, keys: Sequence[str], args: Sequence[int | str], on_error: OnError
    ) -> asyncio.Future[None]:
        """Queue `script` to run soon; the future is done once it ran or failed (`on_error` told why).
        Its reply is dropped: deferred scripts are ones whose effect is all that matters."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._deferred.append(_Item(script, [len(keys), *keys, *args], future, on_error))
        if self._sender is not None:
            if len(self._deferred) >= self.max_batch:
                self._flush_due = True  # taken by the sender's next pipeline
        elif self._closed or len(self._deferred) >= self.max_batch:
            self._flush_due = True
            self._start(loop)
        elif self._timer is None:
            later = self._call_later or loop.call_later
            self._timer = later(self.flush_interval_s, self._flush_timer)
        return future

    async def flush(self) -> None:
        """Send everything queued now and wait until it has been answered (or has failed)."""
        while self._calls or self._deferred or self._sender is not None:
            self._flush_due = True
            if self._sender is None:
                self._start(asyncio.get_running_loop())
            sender = self._sender
            if sender is not None:
                await asyncio.shield(sender)

    async def close(self) -> None:
        """Flush what is queued, bounded by `timeout_s`, then close the client. What could not be sent
        fails (RedisUnavailable). Later calls still work; their client is closed after each use."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.flush()
        except TimeoutError:
            if self._sender is not None:
                self._sender.cancel()
                await asyncio.gather(self._sender, return_exceptions=True)
        self._fail(self._take_all(), "closed before it was sent")
        await self._close_client()

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._sender = loop.create_task(self._send_while_queued())

    def _flush_timer(self) -> None:
        self._timer = None
        if not self._deferred:
            return  # they went with a call's pipeline
        self._flush_due = True
        if self._sender is None:
            self._start(asyncio.get_running_loop())

    async def _send_while_queued(self) -> None:
        batch: list[_Item] = []
        try:
            while True:
                batch = self._take()
                if not batch:
                    break
                await self._send(batch)
                batch = []
        except BaseException:
            # Cancelled (close ran out of time): nothing in flight may be left waiting.
            self._fail(batch, "cancelled")
            raise
        finally:
            self._sender = None
            if self._closed:
                await self._close_client()
            elif self._deferred and self._timer is None:
                later = self._call_later or asyncio.get_running_loop().call_later
                self._timer = later(self.flush_interval_s, self._flush_timer)

    def _take(self) -> list[_Item]:
        """The next pipeline: queued deferred items (when due, or riding with calls), then the calls."""
        calls = [item for item in self._calls if not item.future.done()]  # skip timed out, cancelled
        self._calls = []
        if not (calls or self._flush_due or len(self._deferred) >= self.max_batch):
            return []
        deferred, self._deferred = self._deferred[: self.max_batch], self._deferred[self.max_batch :]
        self._flush_due = len(self._deferred) >= self.max_batch
        return deferred + calls

    def _take_all(self) -> list[_Item]:
        items, self._calls, self._deferred = self._deferred + self._calls, [], []
        return items

    async def _send(self, batch: list[_Item]) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                replies = await self._pipeline(batch)
        except TimeoutError:
            self._fail(batch, f"no answer within {self.timeout_s * 1000:.0f} ms")
            return
        except (RedisError, OSError) as exc:
            self._fail(batch, f"{type(exc).__name__}: {exc}")
            return
        for item, reply in zip(batch, replies, strict=True):
            if isinstance(reply, Exception):
                self._fail([item], f"{type(reply).__name__}: {reply}")
            elif not item.future.done():
                item.future.set_result(None if item.on_error is not None else reply)

    async def _pipeline(self, batch: list[_Item]) -> list[Any]:
        conn = self._conn
        if conn is None:
            if self._client is None:
                # Built lazily so the client binds to the running event loop.
                self._client = self._client_factory()
            # Held while the batcher is open: one pipeline is in flight at a time, and the pool's
            # checkout and release cost as much as the commands. redis-py reconnects it by itself.
            conn = self._conn = await self._client.connection_pool.get_connection()  # type: ignore[no-untyped-call]
        self.pipelines += 1
        replies = await _exchange(conn, [("EVALSHA", item.script.sha, *item.args) for item in batch])
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            # NOSCRIPT: the script did not run (a new or restarted server). Load it, send those again.
            scripts = {batch[i].script.sha: batch[i].script.text for i in missing}
            await _exchange(conn, [("SCRIPT", "LOAD", text) for text in scripts.values()])
            again = await _exchange(conn, [("EVALSHA", batch[i].script.sha, *batch[i].args) for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    @staticmethod
    def _fail(items: list[_Item], why: str) -> None:
        for item in items:
            if item.on_error is not None:
                item.on_error(RedisUnavailable(why))
                if not item.future.done():
                    item.future.set_result(None)
            elif not item.future.done():
                item.future.set_exception(RedisUnavailable(why))

    async def _close_client(self) -> None:
        client, conn, self._client, self._conn = self._client, self._conn, None, None
        if client is not None:
            if conn is not None:
                await client.connection_pool.release(conn)
            await client.aclose()


def _pack(conn: AbstractConnection, commands: list[tuple[Any, ...]]) -> bytes | list[bytes]:
    if _hiredis is None:
        return conn.pack_commands(commands)
    # redis-py's asyncio connection packs in Python even when hiredis is there (~15 µs a script
    # call); its sync connection's hiredis packer does it in C.
    return b"".join(chunk for command in commands for chunk in _hiredis.pack(*command))


async def _exchange(conn: AbstractConnection, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send `commands` in one write and read one reply each; an error reply is returned in its place.
    With the connection's retry policy: a connection found dead (a restarted server) is reconnected
    and the whole batch sent again, so the scripts sent this way must be idempotent."""

    packed = _pack(conn, commands)

    async def once() -> list[Any]:
        await conn.send_packed_command(packed)
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except ResponseError as exc:  # read whole: the connection stays in step
                replies.append(exc)
        return replies

    async def reconnect(_error: Exception) -> None:
        await conn.disconnect()

    result: list[Any] = await conn.retry.call_with_retry(once, reconnect)
    return result
