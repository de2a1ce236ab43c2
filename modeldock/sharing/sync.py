"""The exchange loop: every `interval_ms`, publish this replica's share and take in its peers'.

Each exchange builds the share synchronously (no await while the ledger is read), then makes one
bounded Redis round trip holding nothing, then applies the peers' shares synchronously. Nothing on a
request's path waits for Redis: a pick reads whatever the last exchange applied.

Failure: an exchange that errs or takes longer than `timeout_ms` keeps the last peers' view while
it is younger than `ttl_ms` (a blip changes nothing), then drops to the local view (every replica on
its own, as without sharing) with one warning and `modeldock_sharing_shared 0`. The next good
exchange brings the shared view back, logged, within one interval of Redis answering again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.exceptions import RedisError

from modeldock.clock import Clock
from modeldock.flowcontrol.queue_share import QueuedFlow
from modeldock.flowcontrol.standing_share import ModelStanding
from modeldock.picking.peers import Holding, PeerLoad
from modeldock.redis_client import LogThrottle, RedisUnavailable
from modeldock.sharing.config import SharingConfig
from modeldock.sharing.records import ReplicaShare, decode, encode
from modeldock.sharing.store import ShareStore

log = logging.getLogger("modeldock.sharing")


class LoadBoard(Protocol):
    """What the picker gives and takes (`Picker.holdings`, `Picker.set_peers`)."""

    def holdings(self) -> list[Holding]: ...

    def set_peers(self, peers: Mapping[str, PeerLoad]) -> None: ...


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
        self.age = Gauge("modeldock_sharing_view_age_seconds", "Seconds since the last good exchange "
                         "(how stale the peers' holdings may be)", registry=registry)


class Sharing:
    def __init__(self, board: LoadBoard, store: ShareStore, clock: Clock, config: SharingConfig,
                 registry: CollectorRegistry | None = None, replica: str | None = None,
                 standing: StandingBoard | None = None, queues: QueueBoard | None = None) -> None:
        self._board = board
        self._standing = standing
        self._queues = queues
        self._store = store
        self._clock = clock
        self.replica = replica or config.replica_name()
        self.interval = config.interval_ms / 1000.0
        self.min_gap = config.min_gap_ms / 1000.0
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
        self.metrics.age.set_function(self._age)

    def _age(self) -> float:
        return -1.0 if self.last_ok is None else self._clock.monotonic() - self.last_ok

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="sharing")

    def nudge(self) -> None:
        """Something changed here (a pick, a release): exchange sooner than the interval, at most one
        `min_gap_ms` after the last. Synchronous and cheap: called on every claim and release."""
        self._wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            self._wake.clear()
            await self.exchange()
            self.first.set()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, self.interval - (loop.time() - started))):
                    await self._wake.wait()
            gap = self.min_gap - (loop.time() - started)
            if gap > 0:
                await asyncio.sleep(gap)

    async def exchange(self) -> bool:
        """One exchange; True when it reached Redis."""
        standing = self._standing.share() if self._standing is not None else ()
        flows = self._queues.flows() if self._queues is not None else ()
        share = encode(ReplicaShare(holdings=tuple(self._board.holdings()), standing=standing, queued=flows))
        started = self._clock.monotonic()
        try:
            async with asyncio.timeout(self.timeout):
                received = await self._store.exchange(self.replica, share, self.ttl_ms)
        except (RedisError, RedisUnavailable, OSError, TimeoutError) as exc:
            self._failed(exc)
            return False
        now = self._clock.monotonic()
        self.metrics.seconds.observe(now - started)
        self.metrics.exchanges.labels("ok").inc()
        half_trip = (now - started) / 2  # the ages are Redis's at the script: about half the round trip ago
        shares: list[tuple[float, Sequence[Holding]]] = []
        standings: list[Sequence[ModelStanding]] = []
        queued: list[QueuedFlow] = []
        for _peer, age, payload in received:
            try:
                peer = decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.metrics.bad_shares.inc()
                continue
            shares.append((age + half_trip, peer.holdings))
            standings.append(peer.standing)
            queued.extend(peer.queued)
        self._apply(PeerLoad.merge(shares, now), len(shares), standings, queued)
        if not self.shared:
            self.shared = True
            self.metrics.shared.set(1)
            if self.last_ok is not None:
                log.warning("sharing: Redis answers again; picking counts the %d peer replicas' holdings", len(shares))
            else:
                log.info("sharing: replica %s sees %d peer replicas", self.replica, len(shares))
        self.last_ok = now
        return True

    def _apply(self, peers: Mapping[str, PeerLoad], count: int,
               standings: Sequence[Sequence[ModelStanding]] = (), queued: Sequence[QueuedFlow] = ()) -> None:
        self._board.set_peers(peers)
        if self._standing is not None:
            self._standing.apply_peers(standings)
        if self._queues is not None:
            self._queues.apply_peer_flows(queued)
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
            self._apply({}, 0)
            log.warning("sharing: no exchange with Redis for %.1fs (%s); each replica picks on its own view "
                        "until Redis answers", self.ttl, outcome)
        elif self._throttle.ready():
            log.warning("sharing: exchange failed (%s: %s); keeping the peers' last holdings for up to %.1fs",
                        outcome, type(exc).__name__, self.ttl)

    async def stop(self) -> None:
        """Stop exchanging and take this replica's share out, so its peers forget it at once."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            async with asyncio.timeout(self.timeout * 5):
                await self._store.leave(self.replica)
        except (RedisError, RedisUnavailable, OSError, TimeoutError):
            pass  # its share expires within the TTL anyway
        await self._store.close()
