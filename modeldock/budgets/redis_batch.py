"""Lua script calls to one Redis, several to a round trip (one write, one reply each).

Each round trip costs this process ~100-200 µs of CPU (redis-py, the socket, the event loop
wake-up) whatever it carries, so calls that can share one do:

- `call` (the request path, e.g. a token reserve) is awaited. With nothing in flight it is sent at
  once, by the caller's own task, so concurrency 1 waits for nothing; while a write is in flight,
  later calls queue and all go in the next one when it returns (at most about one round trip of
  waiting).
- `defer` (off the request path: settlements, refunds) rides ahead of the next call in its write,
  or is sent `flush_interval_s` after it was queued, or at once when `max_batch` are queued.

Every item is its own EVALSHA (no MULTI): its own atomic script run and its own reply or error.
One write is in flight at a time, so items reach Redis in the order they were queued (queued
deferred items first). On a Redis Cluster (a `RedisCluster` client) the write is split by node, one
held connection each (redis_batch_cluster.py); items keep their order per node. A call is bounded
by `timeout_s` from when it was made, its wait in the queue included; every failure (refused,
reset, timeout, error reply) is `RedisUnavailable`. A call that times out or is cancelled after it
was sent may still have run: undoing it is the caller's job (e.g. a refund through `defer`).
Scripts must be idempotent: a write on a connection found dead is sent again once, and deferred
items riding with a cancelled call are queued again.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.utils import HIREDIS_AVAILABLE

from modeldock.budgets.redis_batch_cluster import ClusterRoutes
from modeldock.redis_client import RedisUnavailable

if HIREDIS_AVAILABLE:  # redis[hiredis]: redis-py parses the replies in C; _pack packs in C
    from hiredis import pack_command

FLUSH_INTERVAL_S = 0.01
MAX_BATCH = 64


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


# (delay seconds, callback) -> a handle to cancel it; `loop.call_later` unless a test injects one.
CallLater = Callable[[float, Callable[[], None]], TimerHandle]
OnError = Callable[[RedisUnavailable], None]


class Script:
    """A Lua script known by its SHA1, loaded through each new connection in its first write."""

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
        client_factory: Callable[[], Redis | RedisCluster],
        *,
        timeout_s: float,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        max_batch: int = MAX_BATCH,
        call_later: CallLater | None = None,
    ) -> None:
        self._client_factory = client_factory
        self._client: Redis | RedisCluster | None = None
        self._conn: AbstractConnection | None = None
        self._cluster: ClusterRoutes[_Item] | None = None  # a Redis Cluster: the write split by node
        self._loaded: set[str] = set()  # scripts loaded through the held connection since it connected
        self.timeout_s = timeout_s
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self._call_later = call_later
        self._calls: list[_Item] = []
        self._deferred: list[_Item] = []
        self._busy = False  # a write is in flight (sent by a caller, or by the sender task)
        self._sender: asyncio.Task[None] | None = None
        self._idle: asyncio.Future[None] | None = None  # for flush(): done when nothing is in flight
        self._timer: TimerHandle | None = None
        self._closing: asyncio.Task[None] | None = None
        self._flush_due = False
        self._closed = False
        self.round_trips = 0  # writes sent, i.e. round trips (for tests and benchmarks)

    async def call(self, script: Script, keys: Sequence[str], args: Sequence[int | str]) -> Any:
        """Run `script` and return its reply; RedisUnavailable if it fails or takes over `timeout_s`."""
        loop = asyncio.get_running_loop()
        item = _Item(script, [len(keys), *keys, *args], loop.create_future(), None)
        if self._busy:
            self._calls.append(item)
            try:
                async with asyncio.timeout(self.timeout_s):
                    return await item.future
            except TimeoutError:
                raise RedisUnavailable(f"no answer within {self.timeout_s * 1000:.0f} ms") from None
        # Nothing in flight: send it now from this task (no task to start, no wait), and queued
        # deferred items with it.
        self._busy = True
        batch = [*self._take_deferred(), item]
        try:
            await self._send(batch)
        except asyncio.CancelledError:
            # The connection was dropped mid-call: the deferred items go again (they are idempotent).
            self._deferred[:0] = [it for it in batch if it.on_error is not None and not it.future.done()]
            raise
        finally:
            self._went_idle(loop)
        return item.future.result()

    def defer(
        self, script: Script, keys: Sequence[str], args: Sequence[int | str], on_error: OnError
    ) -> asyncio.Future[None]:
        """Queue `script` to run soon; the future is done once it ran or failed (`on_error` told why).
        Its reply is dropped: deferred scripts are ones whose effect is all that matters."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self._deferred.append(_Item(script, [len(keys), *keys, *args], future, on_error))
        if self._closed or len(self._deferred) >= self.max_batch:
            self._flush_due = True
            if not self._busy:
                self._start(loop)
        elif self._timer is None and not self._busy:
            self._arm(loop)
        return future

    async def flush(self) -> None:
        """Send everything queued now and wait until it has been answered (or has failed)."""
        loop = asyncio.get_running_loop()
        while self._calls or self._deferred or self._busy:
            self._flush_due = True
            if not self._busy:
                self._start(loop)
            if self._idle is None:
                self._idle = loop.create_future()
            await asyncio.shield(self._idle)

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
            queued, self._deferred, self._calls = [*self._deferred, *self._calls], [], []
            self._fail(queued, "closed before it was sent")
            if self._sender is not None:
                self._sender.cancel()
                await asyncio.gather(self._sender, return_exceptions=True)
        await self._close_client()
        if self._closing is not None:
            await self._closing

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._busy = True
        self._sender = loop.create_task(self._send_while_queued())

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        later = self._call_later or loop.call_later
        self._timer = later(self.flush_interval_s, self._flush_timer)

    def _flush_timer(self) -> None:
        self._timer = None
        if not self._deferred:
            return  # they went with a call
        self._flush_due = True
        if not self._busy:
            self._start(asyncio.get_running_loop())

    def _went_idle(self, loop: asyncio.AbstractEventLoop) -> None:
        """After a write: the calls that queued meanwhile (and due deferred items) go next."""
        self._busy = False
        if self._calls or (self._deferred and (self._flush_due or self._closed)):
            self._start(loop)
            return
        if self._deferred and self._timer is None and not self._closed:
            self._arm(loop)
        if self._idle is not None:
            self._idle.set_result(None)
            self._idle = None
        if self._closed and self._client is not None:
            # Closed, then used again (a settlement for a retired window): do not keep the client.
            self._closing = loop.create_task(self._close_client())

    async def _send_while_queued(self) -> None:
        batch: list[_Item] = []
        try:
            while batch := self._take():
                await self._send(batch)
            batch = []
        except BaseException:
            # Cancelled (close ran out of time): nothing in flight may be left waiting.
            self._fail(batch, "cancelled")
            raise
        finally:
            self._sender = None
            self._went_idle(asyncio.get_running_loop())

    def _take(self) -> list[_Item]:
        """The next write: queued deferred items (when due, or riding with calls), then the calls."""
        calls = [item for item in self._calls if not item.future.done()]  # skip timed out, cancelled
        self._calls = []
        if not (calls or self._flush_due or self._closed or len(self._deferred) >= self.max_batch):
            return []
        return self._take_deferred() + calls

    def _take_deferred(self) -> list[_Item]:
        deferred, self._deferred = self._deferred[: self.max_batch], self._deferred[self.max_batch :]
        self._flush_due = len(self._deferred) >= self.max_batch
        return deferred

    async def _send(self, batch: list[_Item]) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                replies = await self._round_trip(batch)
        except TimeoutError:
            self._loaded.clear()  # redis-py dropped the connection
            self._fail(batch, f"no answer within {self.timeout_s * 1000:.0f} ms")
            return
        except (RedisError, OSError) as exc:
            self._loaded.clear()
            self._fail(batch, f"{type(exc).__name__}: {exc}")
            return
        except asyncio.CancelledError:
            self._loaded.clear()
            raise
        if replies is not None:
            self._resolve(batch, replies)

    def _resolve(self, items: Sequence[_Item], replies: Sequence[Any]) -> None:
        for item, reply in zip(items, replies, strict=True):
            if isinstance(reply, Exception):
                self._fail([item], f"{type(reply).__name__}: {reply}")
            elif not item.future.done():
                item.future.set_result(None if item.on_error is not None else reply)

    async def _round_trip(self, batch: list[_Item]) -> list[Any] | None:
        """The replies in order, or None when they were resolved already (a cluster, node by node)."""
        conn = self._conn
        if conn is None:
            if self._cluster is not None:
                self.round_trips += 1
                await self._cluster.round_trip(batch)
                return None
            if self._client is None:
                # Built lazily so the client binds to the running event loop.
                self._client = self._client_factory()
            if isinstance(self._client, RedisCluster):
                self._cluster = ClusterRoutes(self._client, self._resolve, _exchange)
                self.round_trips += 1
                await self._cluster.round_trip(batch)
                return None
            # Held while the batcher is open: one write is in flight at a time, and the pool's
            # checkout and release cost as much as the commands. redis-py reconnects it by itself.
            conn = self._conn = await self._client.connection_pool.get_connection()  # type: ignore[no-untyped-call]
        self.round_trips += 1

        async def once(items: list[_Item]) -> list[Any]:
            # Scripts not yet loaded through this connection go first, in the same write, so a new
            # or restarted server runs every item, in queue order, without a NOSCRIPT round trip.
            loads = {item.script.sha: item.script.text for item in items if item.script.sha not in self._loaded}
            evals = [("EVALSHA", item.script.sha, *item.args) for item in items]
            replies = await _exchange(conn, [*(("SCRIPT", "LOAD", text) for text in loads.values()), *evals])
            self._loaded.update(loads)
            return replies[len(loads) :]

        async def reconnect(_error: Exception) -> None:
            self._loaded.clear()
            await conn.disconnect()

        # redis-py's retry policy: a connection found dead (a restarted server) is reconnected and
        # the batch sent again, so the scripts sent through a batcher must be idempotent.
        replies: list[Any] = await conn.retry.call_with_retry(lambda: once(batch), reconnect)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            # Flushed (SCRIPT FLUSH) on a live connection: those did not run; load and send them again.
            self._loaded.clear()
            again = await once([batch[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    @staticmethod
    def _fail(items: list[_Item], why: str) -> None:
        for item in items:
            if item.future.done():
                continue  # answered already (a cluster's other node), or a call that gave up waiting
            if item.on_error is not None:
                item.on_error(RedisUnavailable(why))
                if not item.future.done():
                    item.future.set_result(None)
            elif not item.future.done():
                item.future.set_exception(RedisUnavailable(why))

    async def _close_client(self) -> None:
        client, conn, self._client, self._conn = self._client, self._conn, None, None
        cluster, self._cluster = self._cluster, None
        self._loaded = set()
        if cluster is not None:
            await cluster.close()
        elif isinstance(client, RedisCluster):
            await client.aclose()
        elif client is not None:
            if conn is not None:
                await client.connection_pool.release(conn)
            await client.aclose()


def _pack(conn: AbstractConnection, commands: list[tuple[Any, ...]]) -> bytes | list[bytes]:
    if not HIREDIS_AVAILABLE:
        return conn.pack_commands(commands)
    # redis-py's asyncio connection packs in Python even when hiredis is there (~10 µs a script
    # call, 2.5 µs in hiredis). Every argument here is a str or an int.
    return b"".join([pack_command(command) for command in commands])


async def _exchange(conn: AbstractConnection, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Send `commands` in one write and read one reply each; an error reply is returned in its place."""
    await conn.send_packed_command(_pack(conn, commands))
    replies: list[Any] = []
    for _ in commands:
        try:
            replies.append(await conn.read_response())
        except ResponseError as exc:  # read whole: the connection stays in step
            replies.append(exc)
    return replies
