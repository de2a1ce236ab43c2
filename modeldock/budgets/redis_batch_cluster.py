"""`RedisBatch`'s round trip on a Redis Cluster: each item to the master of its first key's slot.

A batch is split by node (the slot map is redis-py's, `RedisCluster.nodes_manager`), each node's part
goes in one write on a connection held for that node, the nodes are written to concurrently, and each
node's replies are handed back as soon as that node answers (a hung node delays only its own items;
the batch's `timeout_s` fails what is left). Every script's keys share one `{tenant}` hash tag, so the
first key's slot is every key's.

- MOVED (a slot migrated, or a replica promoted): the slot map is patched from the reply
  (`move_slot`) and the item sent again to the new owner, at most `MAX_REDIRECTS` times.
- ASK (a slot mid-migration whose keys already moved): ASKING then the EVALSHA, in one write to the
  node the reply names.
- A node that refuses or resets: its connection is reconnected and its part sent once more (the
  scripts are idempotent); failing again, its items fail (`RedisUnavailable`, by the batcher) and the
  slot map is refreshed before the next round trip, at most every `REFRESH_MIN_S`, so the items of a
  dead master fail fast until its replica is promoted and then go to it, without a restart.
- NOSCRIPT (a promoted replica has not loaded the scripts): loaded and sent again, as on one node.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from redis.asyncio import RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import AbstractConnection
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    ClusterError,
    ConnectionError,
    MovedError,
    NoScriptError,
    RedisError,
)

__all__ = ["MAX_REDIRECTS", "REFRESH_MIN_S", "ClusterRoutes"]

MAX_REDIRECTS = 2  # MOVED or ASK followed per item and round trip
REFRESH_MIN_S = 0.1  # slot map refreshes after a failure, at most this often



class _Script(Protocol):
    @property
    def sha(self) -> str: ...
    @property
    def text(self) -> str: ...


class BatchItem(Protocol):
    """What this module reads of the batcher's items (redis_batch._Item)."""

    @property
    def script(self) -> _Script: ...
    @property
    def args(self) -> list[Any]: ...  # numkeys, the keys, the script's args


T = TypeVar("T", bound=BatchItem)
# An item and, after an ASK, the node to send it to with ASKING (None: its slot's master).
Entry = tuple[T, ClusterNode | None]
Exchange = Callable[[AbstractConnection, list[tuple[Any, ...]]], Awaitable[list[Any]]]


class _Held:
    """The connection held to one node, and the scripts loaded through it since it connected."""

    __slots__ = ("conn", "loaded", "node")

    def __init__(self, node: ClusterNode) -> None:
        self.node = node
        self.conn: AbstractConnection = node.acquire_connection()
        self.loaded: set[str] = set()


class ClusterRoutes(Generic[T]):
    def __init__(self, client: RedisCluster, resolve: Callable[[Sequence[T], Sequence[Any]], None],
                 exchange: Exchange) -> None:
        self._client = client
        self._resolve = resolve  # the batcher's: sets each item's reply or fails it
        self._exchange = exchange  # the batcher's: one write, one reply each (error replies in place)
        self._held: dict[str, _Held] = {}
        self._ready = False
        self._stale = False  # a node failed: refresh the slot map before the next round trip
        self._failed_node: str | None = None
        self._refreshed_at = float("-inf")

    async def round_trip(self, batch: list[T]) -> None:
        """Send every item to its node and resolve it there; raises only when no slot map can be had."""
        await self._slot_map()
        pending: list[Entry[T]] = [(item, None) for item in batch]
        for _ in range(1 + MAX_REDIRECTS):
            groups = self._group(pending)
            if not groups:
                return
            # One write per node, all at once; each node's redirected items come back for the next pass
            # (never two writes on one held connection at a time).
            if len(groups) == 1:  # one node (a single call, say): no task to start
                ((node, entries),) = groups.values()
                pending = await self._node_trip(node, entries)
            else:
                results = await asyncio.gather(*(self._node_trip(node, entries) for node, entries in groups.values()))
                pending = [entry for redirected in results for entry in redirected]
            if not pending:
                return
        self._resolve([item for item, _ in pending],
                      [ClusterError(f"still redirected after {MAX_REDIRECTS} redirects")] * len(pending))

    async def close(self) -> None:
        self._held.clear()
        await self._client.aclose()  # disconnects every node's connections, the held ones too

    async def _slot_map(self) -> None:
        if not self._ready:
            await self._client.initialize()  # the first slot map (bounded by the batcher's timeout)
            self._ready = True
        elif self._stale and time.monotonic() - self._refreshed_at >= REFRESH_MIN_S:
            self._stale, self._refreshed_at = False, time.monotonic()
            try:
                # The node that failed is asked last (it may be the one that is gone).
                await self._client.nodes_manager.initialize(last_failed_node_name=self._failed_node)
            except BaseException:
                self._stale = True
                raise
            self._drop_gone_nodes()

    def _group(self, pending: list[Entry[T]]) -> dict[str, tuple[ClusterNode, list[Entry[T]]]]:
        groups: dict[str, tuple[ClusterNode, list[Entry[T]]]] = {}
        manager = self._client.nodes_manager
        for item, target in pending:
            node = target
            if node is None:
                key = item.args[1] if item.args[0] else ""
                try:
                    node = manager.get_node_from_slot(key_slot(str(key).encode()))
                except RedisError as exc:  # SlotNotCoveredError: no master for it in the map
                    self._stale = True
                    self._resolve([item], [exc])
                    continue
            groups.setdefault(node.name, (node, []))[1].append((item, target))
        return groups

    async def _node_trip(self, node: ClusterNode, entries: list[Entry[T]]) -> list[Entry[T]]:
        """One node's part of the batch: its replies resolved, its redirected entries returned."""
        items = [item for item, _ in entries]
        held: _Held | None = None
        try:
            held = self._hold(node)
            replies = await self._send(held, entries)
        except (RedisError, OSError) as exc:
            self._stale, self._failed_node = True, node.name
            self._resolve(items, [exc] * len(items))
            return []
        except BaseException:
            if held is not None:
                held.loaded.clear()  # timed out or cancelled mid-read: redis-py dropped the connection
            raise
        redirected: list[Entry[T]] = []
        done: list[T] = []
        answers: list[Any] = []
        for item, reply in zip(items, replies, strict=True):
            if isinstance(reply, AskError):  # MovedError is an AskError
                if not reply.host:
                    reply.host = node.host  # a node that does not know its own address sends ""
                if isinstance(reply, MovedError):
                    await self._client.nodes_manager.move_slot(reply)
                    redirected.append((item, None))
                    continue
                manager = self._client.nodes_manager
                target = manager.get_node(*manager.remap_host_port(reply.host, reply.port))
                if target is not None:
                    redirected.append((item, target))
                    continue
                self._stale = True  # an ASK to a node not in the map: fails now, the map is refreshed
            elif isinstance(reply, ClusterDownError):
                self._stale = True
            done.append(item)
            answers.append(reply)
        self._resolve(done, answers)
        return redirected

    async def _send(self, held: _Held, entries: list[Entry[T]]) -> list[Any]:
        conn = held.conn
        if not conn.is_connected:
            held.loaded.clear()

        async def once(part: list[Entry[T]]) -> list[Any]:
            loads = {item.script.sha: item.script.text for item, _ in part if item.script.sha not in held.loaded}
            commands: list[tuple[Any, ...]] = [("SCRIPT", "LOAD", text) for text in loads.values()]
            for item, asking in part:
                if asking is not None:
                    commands.append(("ASKING",))  # right before its EVALSHA, on the same connection
                commands.append(("EVALSHA", item.script.sha, *item.args))
            replies = await self._exchange(conn, commands)
            held.loaded.update(loads)
            out, i = [], len(loads)
            for _, asking in part:
                i += asking is not None
                out.append(replies[i])
                i += 1
            return out

        try:
            replies = await once(entries)
        except (ConnectionError, OSError):
            # A connection found dead (the node restarted, or closed it): once more on a new one.
            held.loaded.clear()
            await conn.disconnect()
            replies = await once(entries)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            held.loaded.clear()  # a promoted replica, or SCRIPT FLUSH: load and send those again
            again = await once([entries[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        return replies

    def _hold(self, node: ClusterNode) -> _Held:
        held = self._held.get(node.name)
        if held is None or held.node is not node:
            held = self._held[node.name] = _Held(node)
        return held

    def _drop_gone_nodes(self) -> None:
        """Forget held connections of nodes the refreshed map no longer has (redis-py closes them)."""
        cache = self._client.nodes_manager.nodes_cache
        for name in [name for name, held in self._held.items() if cache.get(name) is not held.node]:
            del self._held[name]

