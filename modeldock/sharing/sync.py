"""The exchange loop: every `interval_ms`, publish this replica's share and take in its peers'.

Each exchange builds the share synchronously (no await while the ledger is read), then makes one
bounded Redis round trip holding nothing, then applies the peers' shares synchronously. Nothing on a
request's path waits for Redis: a pick reads whatever the last exchange applied.

Between exchanges, every peer's share arrives as it is written (the script publishes it; `listen`
takes it in synchronously): a peer's pick is in this replica's view about one Redis hop after that
peer's exchange. The exchanges still read every share: they forget the dead and fill any lost push.

Failure: an exchange that errs or takes longer than `timeout_ms` keeps the last peers' view while
it is younger than `ttl_ms` (a blip changes nothing), then drops to the local view (every replica on
its own, as without sharing) with one warning and `modeldock_sharing_shared 0`. The next good
exchange brings the shared view back, logged, within one interval of Redis answering again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.exceptions import RedisError

from modeldock.clock import Clock
from modeldock.flowcontrol.queue_share import QueuedFlow
from modeldock.flowcontrol.standing_share import ModelStanding
from modeldock.picking.peers import Holding, PeerLoad
from modeldock.picking.relay import PeerPage
from modeldock.redis_client import LogThrottle, RedisUnavailable
from modeldock.sharing.config import SharingConfig
from modeldock.sharing.records import ReplicaShare, decode, encode
from modeldock.sharing.split import ScrapeSplit
from modeldock.sharing.store import ShareStore
from modeldock.types import Endpoint

log = logging.getLogger("modeldock.sharing")

PAGE_WINDOW_EXCHANGES = 3  # a page read here is in this many intervals' shares


class LoadBoard(Protocol):
    """What the picker gives and takes (`Picker.holdings`, `Picker.set_peers`, `Picker.fullness`)."""

    def holdings(self) -> list[Holding]: ...

    def set_peers(self, peers: Mapping[str, PeerLoad]) -> None: ...

    def fullness(self, endpoint: Endpoint) -> float: ...


class PageBoard(Protocol):
    """What the picker gives and takes of the pages read (`Picker.pages`, `Picker.take_pages`)."""

    def pages(self, window: float = ...) -> tuple[PeerPage, ...]: ...

    def take_pages(self, reader: str, pages: Iterable[PeerPage], age: float) -> int: ...


class StandingBoard(Protocol):
    """What the fair queue's standing gives and takes (`Standing.share`, `Standing.apply_peers`)."""

    def share(self) -> tuple[ModelStanding, ...]: ...

    def apply_peers(self, peers: Sequence[Sequence[ModelStanding]]) -> None: ...


class QueueBoard(Protocol):
    """What the fair queue gives and takes (`Dispatcher.flows`, `Dispatcher.apply_peer_flows`)."""

    def flows(self) -> tuple[QueuedFlow, ...]: ...

    def apply_peer_flows(self, flows: Iterable[QueuedFlow]) -> None: ...


class SharingMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.peers = Gauge("modeldock_sharing_peers", "Live peer replicas in the last good exchange "
                           "(0 with the local view)", registry=registry)
        self.shared = Gauge("modeldock_sharing_shared", "1 while picking counts the peers' holdings, "
                            "0 on the local view (sharing off, or Redis unreachable for the TTL)", registry=registry)
        self.exchanges = Counter("modeldock_sharing_exchanges", "Exchanges with the peers by outcome",
                                 ["outcome"], registry=registry)
        for outcome in ("ok", "error", "timeout"):  # every outcome exported from the start, at 0
            self.exchanges.labels(outcome)
        self.seconds = Histogram("modeldock_sharing_exchange_seconds", "One exchange's Redis round trip",
                                 buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25), registry=registry)
        self.bad_shares = Counter("modeldock_sharing_bad_shares", "Peer shares that did not decode (skipped)",
                                  registry=registry)
        self.peer_in_flight = Gauge("modeldock_sharing_peer_in_flight", "The peers' requests in flight, "
                                    "as this replica counts them beside its own (modeldock_in_flight)",
                                    registry=registry)
        self.peer_committed = Gauge("modeldock_sharing_peer_committed_tokens", "The peers' committed tokens "
                                    "in flight, beside this replica's (modeldock_picker_committed_tokens)",
                                    registry=registry)
        self.pushes = Counter("modeldock_sharing_pushes", "Peer shares taken in as they were written "
                              "(between this replica's own exchanges)", registry=registry)
        self.pages = Counter("modeldock_sharing_pages", "Endpoint pages a peer read, taken in here instead "
                             "of reading them (picking/relay.py)", registry=registry)
        self.age = Gauge("modeldock_sharing_view_age_seconds", "Seconds since the last good exchange "
                         "(how stale the peers' holdings may be)", registry=registry)


class _Peer:
    """A peer's latest share, when this replica got it and how old it was then."""

    __slots__ = ("age", "got_at", "share")

    def __init__(self, share: ReplicaShare, got_at: float, age: float) -> None:
        self.share = share
        self.got_at = got_at
        self.age = age


class Sharing:
    def __init__(self, board: LoadBoard, store: ShareStore, clock: Clock, config: SharingConfig,
                 registry: CollectorRegistry | None = None, replica: str | None = None,
                 standing: StandingBoard | None = None, queues: QueueBoard | None = None,
                 pages: PageBoard | None = None) -> None:
        self._board = board
        self._pages = pages
        self._standing = standing
        self._queues = queues
        self._store = store
        self._clock = clock
        self.replica = replica or config.replica_name()
        self.interval = config.interval_ms / 1000.0
        self.min_gap = config.min_gap_ms / 1000.0
        self.push_above = config.push_above
        self._peers_queue = False  # a peer has requests queued (its next dispatch turns on our releases)
        self._wake = asyncio.Event()
        self.timeout = config.timeout_ms / 1000.0
        self.ttl_ms = config.ttl_ms
        self.ttl = config.ttl_ms / 1000.0
        self.metrics = SharingMetrics(registry)
        self.shared = False  # picking counts the peers now
        self.last_ok: float | None = None
        self.first = asyncio.Event()  # set after the first exchange, good or not
        self._throttle = LogThrottle(clock, 30.0)
        self._task: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._peers: dict[str, _Peer] = {}
        self._epoch = int.from_bytes(os.urandom(6), "big")  # this process's shares, numbered by _seq
        self._seq = 0
        self.metrics.age.set_function(self._age)
        # Which endpoints this replica reads (split.py); every one while not shared.
        self.split = ScrapeSplit(self.replica)

    def _age(self) -> float:
        return -1.0 if self.last_ok is None else self._clock.monotonic() - self.last_ok

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="sharing")
        self._listener = asyncio.create_task(self.listen(), name="sharing-pushes")

    def nudge(self) -> None:
        """Something changed here: exchange sooner than the interval, at most one `min_gap_ms` after
        the last. Synchronous and cheap."""
        self._wake.set()

    def changed(self, endpoint: Endpoint) -> None:
        """A pick or a release on `endpoint` (the picker's claim and release listeners): pushed at
        once when a peer's next decision can turn on it (the endpoint at least `push_above` full, or
        a peer with requests queued), else with the next interval's exchange."""
        if self._peers_queue or self._board.fullness(endpoint) >= self.push_above:
            self._wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        last_read = loop.time()
        while True:
            started = loop.time()
            # Brought forward by a change here: write and push only (the peers' shares come by
            # their pushes); on the interval, read every share too (the dead are forgotten, a lost
            # push is filled), and always while not shared.
            nudged = self._wake.is_set()
            self._wake.clear()
            read = not nudged or not self.shared or started - last_read >= self.interval
            if read:
                last_read = started
            await self.exchange(read=read)
            self.first.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, self.interval - (loop.time() - started))):
                    await self._wake.wait()
            gap = self.min_gap - (loop.time() - started)
            if gap > 0:
                await asyncio.sleep(gap)

    async def exchange(self, read: bool = True) -> bool:
        """One exchange (with `read`, every peer's share comes back); True when it reached Redis."""
        self._seq += 1
        standing = self._standing.share() if self._standing is not None else ()
        flows = self._queues.flows() if self._queues is not None else ()
        # Each page rides in the shares of PAGE_WINDOW_EXCHANGES intervals: a peer that reads every
        # interval (and takes every push) gets it more than once; one that misses them all covers the
        # endpoint itself once its page is late (extproc/app.py).
        pages = self._pages.pages(self.interval * PAGE_WINDOW_EXCHANGES) if self._pages is not None else ()
        share = encode(ReplicaShare(holdings=tuple(self._board.holdings()), standing=standing, queued=flows,
                                    pages=pages, epoch=self._epoch, seq=self._seq))
        started = self._clock.monotonic()
        try:
            async with asyncio.timeout(self.timeout):
                received = await self._store.exchange(self.replica, share, self.ttl_ms, read)
        except (RedisError, RedisUnavailable, OSError, TimeoutError) as exc:
            self._failed(exc)
            return False
        now = self._clock.monotonic()
        self.metrics.seconds.observe(now - started)
        self.metrics.exchanges.labels("ok").inc()
        if read or not self.shared:
            self._read(received, started, now)
        if not self.shared:
            self.shared = True
            self.metrics.shared.set(1)
            if self.last_ok is not None:
                log.warning("sharing: Redis answers again; picking counts the %d peer replicas' holdings",
                            len(self._peers))
            else:
                log.info("sharing: replica %s sees %d peer replicas", self.replica, len(self._peers))
        self.last_ok = now
        return True

    def _read(self, received: Sequence[tuple[str, float, bytes]], started: float, now: float) -> None:
        half_trip = (now - started) / 2  # the ages are Redis's at the script: about half the round trip ago
        live = set()
        changed = not self.shared  # the view is applied on the first good exchange (and after a fallback)
        for name, age, payload in received:
            if (peer := self._decode(payload)) is not None:
                live.add(name)
                changed |= self._take(name, peer, now, age + half_trip)
        for name in [n for n, p in self._peers.items() if n not in live and p.got_at < started]:
            del self._peers[name]  # gone from Redis (died, left, cut off) and not pushed since we asked
            changed = True
        if changed:  # else every share came by a push first: the view has it already
            self._rebuild(now)

    def pushed(self, name: str, payload: bytes) -> None:
        """A peer's share as it was written (or, empty, that it left): into the view at once."""
        if name == self.replica:
            return
        now = self._clock.monotonic()
        if not payload:
            if self._peers.pop(name, None) is not None and self.shared:
                self._rebuild(now)
            return
        peer = self._decode(payload)
        if peer is not None and self._take(name, peer, now, 0.0) and self.shared:
            self.metrics.pushes.inc()
            self._rebuild(now)

    async def listen(self) -> None:
        """Take in the peers' pushes; resubscribe after a dropped connection (the exchanges carry on
        meanwhile: a lost push is only a later view, at most one interval)."""
        while True:
            try:
                async for name, payload in self._store.pushes(self.replica):
                    self.pushed(name, payload)
            except (RedisError, RedisUnavailable, OSError) as exc:
                if self._throttle.ready():
                    log.warning("sharing: push subscription lost (%s); resubscribing", type(exc).__name__)
            await asyncio.sleep(self.interval)

    def _decode(self, payload: bytes) -> ReplicaShare | None:
        try:
            return decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.metrics.bad_shares.inc()
            return None

    def _take(self, name: str, share: ReplicaShare, now: float, age: float) -> bool:
        held = self._peers.get(name)
        if held is not None and not share.newer_than(held.share):
            return False  # the push of this share or a newer one came first
        self._peers[name] = _Peer(share, now, age)
        if self._pages is not None and share.pages:
            self.metrics.pages.inc(self._pages.take_pages(name, share.pages, age))
        return True

    def _rebuild(self, now: float) -> None:
        peers = self._peers.values()
        loads = PeerLoad.merge(((p.age + now - p.got_at, p.share.holdings) for p in peers), now)
        queued = [msgspec.structs.replace(flow, waited=flow.waited + p.age + now - p.got_at)  # heads' waits now
                  for p in peers for flow in p.share.queued]
        self._peers_queue = bool(queued)
        self._apply(loads, len(self._peers), [p.share.standing for p in peers], queued)

    def _apply(self, peers: Mapping[str, PeerLoad], count: int,
               standings: Sequence[Sequence[ModelStanding]] = (), queued: Sequence[QueuedFlow] = ()) -> None:
        # The standing and the queued flows first: the holdings' room listeners dispatch on them.
        if self._standing is not None:
            self._standing.apply_peers(standings)
        if self._queues is not None:
            self._queues.apply_peer_flows(queued)
        self._board.set_peers(peers)
        self.split.set_peers(self._peers)
        self.metrics.peers.set(count)
        self.metrics.peer_in_flight.set(sum(p.in_flight for p in peers.values()))
        self.metrics.peer_committed.set(sum(p.committed for p in peers.values()))

    def _failed(self, exc: BaseException) -> None:
        outcome = "timeout" if isinstance(exc, TimeoutError) else "error"
        self.metrics.exchanges.labels(outcome).inc()
        now = self._clock.monotonic()
        if self.shared and (self.last_ok is None or now - self.last_ok >= self.ttl):
            self.shared = False
            self.metrics.shared.set(0)
            self._peers.clear()
            self._peers_queue = False
            self._apply({}, 0)
            log.warning("sharing: no exchange with Redis for %.1fs (%s); each replica picks on its own view "
                        "until Redis answers", self.ttl, outcome)
        elif self._throttle.ready():
            log.warning("sharing: exchange failed (%s: %s); keeping the peers' last holdings for up to %.1fs",
                        outcome, type(exc).__name__, self.ttl)

    async def stop(self) -> None:
        """Stop exchanging and take this replica's share out, so its peers forget it at once."""
        tasks = [t for t in (self._task, self._listener) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            async with asyncio.timeout(self.timeout * 5):
                await self._store.leave(self.replica)
        except (RedisError, RedisUnavailable, OSError, TimeoutError):
            pass  # its share expires within the TTL anyway
        await self._store.close()
