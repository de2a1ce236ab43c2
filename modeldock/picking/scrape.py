"""Read every endpoint's /metrics and feed the samples to the picker.

Each endpoint has its own next read (cadence.py): every `interval` while this gateway has
requests there or its model has a queue waiting, every `idle_interval` otherwise, sooner after
a pick there (`hurry`, the picker's claim listener). The loop wakes when the earliest is due
and reads, as one round, every endpoint due by then: concurrently over one keep-alive session,
the round within `timeout` (and `budget`). Only once every fetch of the round has
finished or been cut off are its results applied, in one synchronous loop: no network I/O
happens while the picker's state is touched. Rounds may overlap (a hung endpoint does not hold
the others back), an endpoint is never read twice at once. A failed fetch changes nothing but a
failure count (the old sample just ages) and is retried at the busy cadence.
KV capacity (`cache_config_info`) is read on an endpoint's first pages until found, then once
every `capacity_every` reads of it: it never changes while the server runs, and skipping it
keeps the usual parse to the load series.

`refresh(endpoint)` reads one endpoint's page out of turn, when a request there ended
(`Picker.add_release_listener`): the last page still counts what it held, so until the next
round the endpoint looks fuller than it is (with a queue waiting for room, that is throughput
lost). Not within `refresh_gap` seconds of the endpoint's last read, nor while one is running.

Pages come over kept-alive connections, one per endpoint (pages.py).
A page whose server sends an ETag or Last-Modified is asked for again conditionally; a 304
applies the last sample anew (vLLM's prometheus_client sends neither: every read is a 200).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from prometheus_client import CollectorRegistry

from modeldock.clock import Clock
from modeldock.picking.cadence import Cadence
from modeldock.picking.config import RoutingConfig
from modeldock.picking.metrics import ScrapeMetrics
from modeldock.picking.pages import Page, PageClient, PageError
from modeldock.picking.parse import parse_metrics
from modeldock.picking.signals import Sample
from modeldock.types import Endpoint

log = logging.getLogger(__name__)
T = TypeVar("T")


class ScrapeSink(Protocol):
    """What the Scraper needs from the Picker."""

    def scrape_targets(self) -> Mapping[Endpoint, str | None]: ...

    def observe(self, endpoint: Endpoint, sample: Sample, taken_at: float, in_flight_at: int | None = None,
                out_of_turn: bool = False) -> None: ...

    def observe_failure(self, endpoint: Endpoint) -> None: ...

    def in_flight(self, endpoint: Endpoint) -> int: ...

    def endpoints(self, model: str) -> Sequence[Endpoint]: ...


class Parser(Protocol):
    def __call__(self, text: str, model: str | None, *, capacity: bool = False) -> Sample | None: ...


@dataclass(frozen=True)
class RoundResult:
    samples: dict[Endpoint, Sample] = field(default_factory=dict)
    failures: dict[Endpoint, str] = field(default_factory=dict)  # endpoint -> reason
    seconds: float = 0.0


@dataclass(frozen=True)
class _Fetched:
    sample: Sample | None
    taken_at: float
    in_flight_at: int  # the sink's in-flight count when the page arrived
    reason: str | None  # why there is no sample


@dataclass(frozen=True)
class _Validator:
    """What a server said to ask again with: the page it answered then, for a 304."""

    model: str | None
    headers: dict[str, str]
    sample: Sample


class Scraper:
    """Usage: `scraper = Scraper(picker, clock); scraper.start()` inside the event loop,
    `await scraper.stop()` on shutdown (or `async with scraper:`). Endpoints come from
    `picker.scrape_targets()`, read again once an interval (and by every `scrape_once`).

    idle_interval: seconds between reads of an endpoint with nothing of this gateway's in flight
      and no queue for its model (None: every endpoint every `interval`);
    queued: the models with requests waiting in the gateway's queue now (their endpoints are read
      at the busy cadence);
    scrapes: which endpoints this process reads on the cadence (default all; the others are left
      to a replica that shares what it read: `share`); reads out of turn are for every endpoint;
    busy: also on the busy cadence where this says so (the peers hold requests there);
    parser: `parse_metrics` unless given (the benchmark's before passes a whole-page parse)."""

    def __init__(
        self,
        sink: ScrapeSink,
        clock: Clock,
        *,
        interval: float = 0.5,
        timeout: float = 0.5,
        budget: float = 2.0,
        path: str = "/metrics",
        max_bytes: int = 8 * 1024 * 1024,
        registry: CollectorRegistry | None = None,
        capacity_every: int = 120,
        refresh_gap: float = 0.0,
        idle_interval: float | None = None,
        queued: Callable[[], Iterable[str]] | None = None,
        scrapes: Callable[[Endpoint], bool] | None = None,
        busy: Callable[[Endpoint], bool] | None = None,
        parser: Parser = parse_metrics,
    ) -> None:
        if interval <= 0 or timeout <= 0 or budget <= 0:
            raise ValueError("interval, timeout and budget must be > 0")
        self._sink = sink
        self._clock = clock
        self._cadence = Cadence(interval, idle_interval)
        self._timeout = min(timeout, budget)
        self._budget = budget
        self._client = PageClient(path, max_bytes)
        self._metrics = ScrapeMetrics(registry)
        self._queued = queued
        self._scrapes = scrapes
        self._busy = busy
        self._parse = parser
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._wake_at = float("inf")  # when the sleeping loop wakes by itself (clock time)
        self._capacity_every = max(1, capacity_every)
        self._reads: dict[Endpoint, int] = {}  # scheduled reads of each endpoint so far
        self._capacity_read: dict[Endpoint, int] = {}  # endpoint -> its read that last found the capacity
        self._refresh_gap = refresh_gap  # 0: no reads out of turn
        self._targets: dict[Endpoint, str | None] = {}  # as last read, the ones this process reads
        self._every: dict[Endpoint, str | None] = {}  # as last read, all of them (reads out of turn)
        self._synced_at = float("-inf")  # clock time they were read
        self._read_at: dict[Endpoint, float] = {}  # clock time the last read of each started
        self._reading: set[Endpoint] = set()  # a read of it is under way
        self._validators: dict[Endpoint, _Validator] = {}
        self._queued_now: frozenset[Endpoint] = frozenset()  # endpoints of queued models, as of the last wake
        self._tasks: set[asyncio.Task[object]] = set()

    @classmethod
    def from_config(cls, sink: ScrapeSink, clock: Clock, routing: RoutingConfig, *,
                    registry: CollectorRegistry | None = None,
                    queued: Callable[[], Iterable[str]] | None = None) -> Scraper:
        scrape = routing.scrape
        return cls(sink, clock, interval=scrape.interval_seconds, timeout=scrape.timeout_seconds,
                   budget=scrape.budget_seconds, path=scrape.path, registry=registry,
                   refresh_gap=scrape.refresh_gap_seconds, idle_interval=routing.idle_interval, queued=queued)

    # -- lifecycle -------------------------------------------------------

    def start(self) -> None:
        """Start the background loop; call from inside the running event loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="modeldock-scraper")

    async def stop(self) -> None:
        task, self._task = self._task, None
        for running in [*self._tasks, *([task] if task is not None else [])]:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
        self._client.close()

    async def __aenter__(self) -> Scraper:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        while True:
            try:
                due = self._due()
                if due:
                    self._spawn(self._round(due), "modeldock-scrape-round")
            except Exception:  # a bug in one wake must not end scraping for good
                log.exception("scrape round failed")
            await self._sleep()

    async def _sleep(self) -> None:
        now = self._clock.monotonic()
        at = self._cadence.next_due()
        # Wake at least every interval: new endpoints get their first read within it.
        delay = self._cadence.interval if at is None else min(self._cadence.interval, max(0.001, at - now))
        self._wake.clear()
        self._wake_at = now + delay
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._wake.wait()
        self._wake_at = float("-inf")  # awake: a hurry needs no wake-up

    def _spawn(self, work: Coroutine[object, object, object], name: str) -> None:
        task: asyncio.Task[object] = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- what to read ----------------------------------------------------

    def _sync(self, fresh: bool = False) -> dict[Endpoint, str | None]:
        """Follow the targets (read again once an interval has passed, or when `fresh`: building
        them is O(endpoints) and wakes come several times an interval); put the endpoints of
        queued models on the busy cadence."""
        now = self._clock.monotonic()
        targets = self._targets
        if fresh or now - self._synced_at >= self._cadence.interval:
            self._synced_at = now
            targets = self._read_targets()
        if targets is not self._targets:
            self._cadence.sync(targets, now)
            every = self._every  # what a read out of turn may still use
            _forget(self._reads, every)
            _forget(self._capacity_read, every)
            _forget(self._read_at, every)
            self._client.forget(every)
            _forget(self._validators, every)
            self._targets = targets
        queued: set[Endpoint] = set()
        if self._queued is not None:
            for model in self._queued():
                queued.update(ep for ep in self._sink.endpoints(model) if ep in targets)
        for ep in queued:
            self._cadence.hurry(ep)
        self._queued_now = frozenset(queued)
        return targets

    def share(self, scrapes: Callable[[Endpoint], bool], busy: Callable[[Endpoint], bool],
              idle_interval: float | None = None) -> None:
        """From now on read only where `scrapes` says (checked once an interval), and count `busy`
        endpoints as busy: the replicas split the endpoints and relay their pages (modeldock/sharing).
        `idle_interval`: a shorter idle cadence, so a relayed page still lands within the stale cutoff."""
        self._scrapes, self._busy = scrapes, busy
        if idle_interval is not None:
            self._cadence.idle_interval = max(self._cadence.interval, min(self._cadence.idle_interval, idle_interval))
        self._synced_at = float("-inf")

    def _read_targets(self) -> dict[Endpoint, str | None]:
        """The sink's targets this process reads; the last ones (the same object) when unchanged."""
        targets = self._every = dict(self._sink.scrape_targets())
        if self._scrapes is not None:
            targets = {ep: model for ep, model in targets.items() if self._scrapes(ep)}
        return self._targets if targets == self._targets else targets

    def _due(self) -> dict[Endpoint, str | None]:
        targets = self._sync()
        now = self._clock.monotonic()
        due: dict[Endpoint, str | None] = {}
        for ep in self._cadence.due(now):
            if ep in self._reading:  # read out of turn right now: that read stands for this one
                self._cadence.started(ep, now, busy=True)
            else:
                due[ep] = targets[ep]
        return due

    @property
    def reading(self) -> frozenset[Endpoint]:
        """The endpoints whose page is being read now (a round's or out of turn)."""
        return frozenset(self._reading)

    def due_at(self, endpoint: Endpoint) -> float | None:
        """When `endpoint`'s next scheduled read is due (clock time; None: not a target yet)."""
        return self._cadence.due_at(endpoint)

    def targets_changed(self) -> None:
        """The sink's endpoints changed: follow them at the next wake, now (a new endpoint's first
        read is due at once; else it waited for the once-an-interval re-read of the targets)."""
        self._synced_at = float("-inf")
        if self._task is not None:
            self._wake.set()

    def hurry(self, endpoint: Endpoint) -> None:
        """Put `endpoint` on the busy cadence now (a pick there: its page is read `interval` after
        its last read, at once if that is past). Synchronous and cheap: the picker's claim
        listener calls it on every pick."""
        at = self._cadence.hurry(endpoint)
        if at is not None and at < self._wake_at:
            self._wake.set()

    # -- rounds ----------------------------------------------------------

    async def scrape_once(self) -> RoundResult:
        """Read every current target once and apply the results."""
        return await self._round(self._sync(fresh=True))

    async def scrape_due(self) -> RoundResult:
        """Read the endpoints due now (by the injected clock) and apply the results: one step of the
        background loop, for a caller that drives the clock itself."""
        return await self._round(self._due())

    async def _round(self, targets: dict[Endpoint, str | None]) -> RoundResult:
        if not targets:
            return RoundResult()
        queued = self._queued_now
        now = self._clock.monotonic()
        loop = asyncio.get_running_loop()
        started = loop.time()
        tasks: dict[Endpoint, asyncio.Task[_Fetched]] = {}
        for ep, model in targets.items():
            busy = ep in queued or self._sink.in_flight(ep) > 0 or (self._busy is not None and self._busy(ep))
            self._cadence.started(ep, now, busy)
            self._metrics.read("busy" if busy or not self._cadence.adaptive else "idle")
            self._read_at[ep] = now
            self._reads[ep] = reads = self._reads.get(ep, 0) + 1
            self._reading.add(ep)
            tasks[ep] = asyncio.create_task(self._fetch(ep, model, reads))
        try:
            # Every read of the round started now: one wait bounds each (no timer per read).
            _, pending = await asyncio.wait(tasks.values(), timeout=self._timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=0.1)  # let cancelled requests unwind their connections
        finally:
            self._reading.difference_update(tasks)
        result = RoundResult(seconds=loop.time() - started)
        # Apply everything in one synchronous step.
        cut = "timeout" if self._timeout < self._budget else "budget"
        for ep, task in tasks.items():
            fetched = _outcome(task, cut)
            if fetched.sample is not None:
                self._sink.observe(ep, fetched.sample, fetched.taken_at, fetched.in_flight_at)
                result.samples[ep] = fetched.sample
            else:
                reason = fetched.reason or "unknown"
                self._sink.observe_failure(ep)
                self._cadence.failed(ep)
                self._metrics.error(reason)
                result.failures[ep] = reason
        self._metrics.round.observe(result.seconds)
        return result

    def refresh(self, endpoint: Endpoint) -> None:
        """Read `endpoint`'s page now (see the module doc); only schedules the read, so it may be
        called from the ledger's release path. Nothing while stopped or off, for an endpoint the
        last wake did not list, or within the gap of its last read."""
        if self._refresh_gap <= 0 or self._task is None or endpoint in self._reading:
            return
        if endpoint not in self._every:
            return
        now = self._clock.monotonic()
        if now - self._read_at.get(endpoint, float("-inf")) < self._refresh_gap:
            return
        self._read_at[endpoint] = now
        self._reading.add(endpoint)
        self._spawn(self._refresh(endpoint, self._every[endpoint]), "modeldock-refresh")

    async def _refresh(self, endpoint: Endpoint, model: str | None) -> None:
        try:
            async with asyncio.timeout(self._timeout):
                fetched = await self._fetch(endpoint, model, self._reads.get(endpoint, 0))
        except TimeoutError:
            fetched = _failed("timeout")
        except Exception:  # never let one read end in an unretrieved task exception
            log.exception("scrape of %s failed", endpoint.address)
            return
        finally:
            self._reading.discard(endpoint)
        self._metrics.refresh(fetched.reason or "ok")
        if fetched.sample is not None:  # a failure only ages the last sample; the rounds count it
            self._sink.observe(endpoint, fetched.sample, fetched.taken_at, fetched.in_flight_at, out_of_turn=True)

    # -- one read --------------------------------------------------------

    async def _fetch(self, endpoint: Endpoint, model: str | None, reads: int) -> _Fetched:
        read = self._capacity_read.get(endpoint)
        want_capacity = read is None or reads - read >= self._capacity_every
        validator = self._validators.get(endpoint)
        if validator is not None and validator.model != model:
            validator = None
        try:
            page = await self._client.get(endpoint, validator.headers if validator else None)
        except PageError as exc:
            return _failed(exc.reason)
        # The page reflects the requests we had sent by now; picks made while the
        # rest of the round finishes must still count as corrections on top of it.
        taken_at = self._clock.monotonic()
        in_flight_at = self._sink.in_flight(endpoint)
        if page.status == 304 and validator is not None:
            self._metrics.unchanged()
            sample: Sample | None = validator.sample
        elif page.status != 200:
            return _failed("http_status")
        else:
            sample = self._parse(page.body.decode("utf-8", "replace"), model, capacity=want_capacity)
            if sample is None:
                return _failed("no_series")
            headers = _validator_headers(page)
            if headers:
                self._validators[endpoint] = _Validator(model, headers, sample)
            elif validator is not None:
                del self._validators[endpoint]
        assert sample is not None
        if sample.capacity is not None:
            self._capacity_read[endpoint] = reads
        return _Fetched(sample, taken_at, in_flight_at, None)


def _forget(table: dict[Endpoint, T], keep: Mapping[Endpoint, object]) -> None:
    for gone in table.keys() - keep.keys():
        del table[gone]


def _validator_headers(page: Page) -> dict[str, str]:
    headers = {}
    if page.etag:
        headers["If-None-Match"] = page.etag
    if page.last_modified:
        headers["If-Modified-Since"] = page.last_modified
    return headers


def _failed(reason: str) -> _Fetched:
    return _Fetched(None, 0.0, 0, reason)


def _outcome(task: asyncio.Task[_Fetched], cut: str) -> _Fetched:
    if not task.done() or task.cancelled():
        return _failed(cut)
    exc = task.exception()
    if exc is not None:
        log.warning("scrape task failed unexpectedly: %r", exc)
        return _failed("error")
    return task.result()
