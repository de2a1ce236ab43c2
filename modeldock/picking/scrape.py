"""Scrape every endpoint's /metrics on an interval and feed the samples to the picker.

Each round fetches all current endpoints concurrently (one shared keep-alive
session), each within `timeout`, the whole round within `budget`. Only once
every fetch has finished or been cut off are the results applied, in one
synchronous loop: no network I/O happens while the picker's state is touched.
A failed fetch changes nothing but a failure count: the old sample just ages.
KV capacity (`cache_config_info`) is read on an endpoint's first pages until
found, then once every `capacity_every` rounds: it never changes while the
server runs, and skipping it keeps the usual parse to the load series.

`refresh(endpoint)` reads one endpoint's page out of turn, when a request there
ended (`Picker.add_release_listener`): the last page still counts what it held,
so until the next round the endpoint looks fuller than it is (with a queue
waiting for room, that is throughput lost). At most one such read per endpoint
at a time, and none within `refresh_gap` seconds of the last read started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
from prometheus_client import CollectorRegistry

from modeldock.clock import Clock
from modeldock.picking.metrics import ScrapeMetrics
from modeldock.picking.parse import parse_metrics
from modeldock.picking.signals import Sample
from modeldock.types import Endpoint

log = logging.getLogger(__name__)


class ScrapeSink(Protocol):
    """What the Scraper needs from the Picker."""

    def scrape_targets(self) -> Mapping[Endpoint, str | None]: ...

    def observe(self, endpoint: Endpoint, sample: Sample, taken_at: float, in_flight_at: int | None = None,
                out_of_turn: bool = False) -> None: ...

    def observe_failure(self, endpoint: Endpoint) -> None: ...

    def in_flight(self, endpoint: Endpoint) -> int: ...


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


class Scraper:
    """Usage: `scraper = Scraper(picker, clock); scraper.start()` inside the
    event loop, `await scraper.stop()` on shutdown (or `async with scraper:`).
    Endpoints come from `picker.scrape_targets()` at the start of each round."""

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
        session: aiohttp.ClientSession | None = None,
        registry: CollectorRegistry | None = None,
        capacity_every: int = 120,
        refresh_gap: float = 0.0,
    ) -> None:
        if interval <= 0 or timeout <= 0 or budget <= 0:
            raise ValueError("interval, timeout and budget must be > 0")
        self._sink = sink
        self._clock = clock
        self._interval = interval
        self._timeout = min(timeout, budget)
        self._budget = budget
        self._path = path if path.startswith("/") else "/" + path
        self._max_bytes = max_bytes
        self._session = session
        self._owns_session = session is None
        self._metrics = ScrapeMetrics(registry)
        self._task: asyncio.Task[None] | None = None
        self._round = 0
        self._capacity_every = max(1, capacity_every)
        self._capacity_read: dict[Endpoint, int] = {}  # endpoint -> round its capacity was last read
        self._refresh_gap = refresh_gap  # 0: no reads out of turn
        self._targets: dict[Endpoint, str | None] = {}  # the last round's
        self._read_at: dict[Endpoint, float] = {}  # loop time the last read of each started
        self._refreshing: set[Endpoint] = set()
        self._tasks: set[asyncio.Task[None]] = set()

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
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Scraper:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.scrape_once()
            except Exception:  # a bug in one round must not end scraping for good
                log.exception("scrape round failed")
            await asyncio.sleep(max(0.0, self._interval - (loop.time() - started)))

    # -- one round -------------------------------------------------------

    async def scrape_once(self) -> RoundResult:
        """Scrape every current target once and apply the results."""
        targets = dict(self._sink.scrape_targets())
        if not targets:
            return RoundResult()
        self._round += 1
        for gone in self._capacity_read.keys() - targets.keys():
            del self._capacity_read[gone]
        for gone in self._read_at.keys() - targets.keys():
            del self._read_at[gone]
        self._targets = targets
        loop = asyncio.get_running_loop()
        started = loop.time()
        for ep in targets:
            self._read_at[ep] = started
        session = self._ensure_session()
        tasks = {ep: asyncio.create_task(self._fetch(session, ep, model)) for ep, model in targets.items()}
        _, pending = await asyncio.wait(tasks.values(), timeout=self._budget)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=0.1)  # let cancelled requests unwind their connections
        result = RoundResult(seconds=loop.time() - started)
        # Apply everything in one synchronous step.
        for ep, task in tasks.items():
            fetched = _outcome(task)
            if fetched.sample is not None:
                self._sink.observe(ep, fetched.sample, fetched.taken_at, fetched.in_flight_at)
                result.samples[ep] = fetched.sample
            else:
                reason = fetched.reason or "unknown"
                self._sink.observe_failure(ep)
                self._metrics.error(reason)
                result.failures[ep] = reason
        self._metrics.round.observe(result.seconds)
        return result

    def refresh(self, endpoint: Endpoint) -> None:
        """Read `endpoint`'s page now (see the module doc); only schedules the read, so it may be
        called from the ledger's release path. Nothing while stopped or off, for an endpoint the
        last round did not list, or within the gap of its last read."""
        if self._refresh_gap <= 0 or self._task is None or endpoint in self._refreshing:
            return
        if endpoint not in self._targets:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now - self._read_at.get(endpoint, float("-inf")) < self._refresh_gap:
            return
        self._read_at[endpoint] = now
        self._refreshing.add(endpoint)
        task = loop.create_task(self._refresh(endpoint, self._targets[endpoint]), name="modeldock-refresh")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refresh(self, endpoint: Endpoint, model: str | None) -> None:
        try:
            fetched = await self._fetch(self._ensure_session(), endpoint, model)
        except Exception:  # never let one read end in an unretrieved task exception
            log.exception("scrape of %s failed", endpoint.address)
            return
        finally:
            self._refreshing.discard(endpoint)
        self._metrics.refresh(fetched.reason or "ok")
        if fetched.sample is not None:  # a failure only ages the last sample; the rounds count it
            self._sink.observe(endpoint, fetched.sample, fetched.taken_at, fetched.in_flight_at, out_of_turn=True)

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=2, keepalive_timeout=30)
            self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
            self._owns_session = True
        return self._session

    async def _fetch(self, session: aiohttp.ClientSession, endpoint: Endpoint, model: str | None) -> _Fetched:
        url = f"http://{endpoint.address}{self._path}"
        try:
            async with asyncio.timeout(self._timeout):
                async with session.get(url) as response:
                    if response.status != 200:
                        return _failed("http_status")
                    body = await self._read(response)
        except TimeoutError:
            return _failed("timeout")
        except (aiohttp.ClientError, OSError) as exc:
            log.debug("scrape %s failed: %s", url, exc)
            return _failed("connect")
        if body is None:
            return _failed("too_large")
        # The page reflects the requests we had sent by now; picks made while the
        # rest of the round finishes must still count as corrections on top of it.
        taken_at = self._clock.monotonic()
        in_flight_at = self._sink.in_flight(endpoint)
        read = self._capacity_read.get(endpoint)
        want_capacity = read is None or self._round - read >= self._capacity_every
        sample = parse_metrics(body.decode("utf-8", "replace"), model, capacity=want_capacity)
        if sample is None:
            return _failed("no_series")
        if sample.capacity is not None:
            self._capacity_read[endpoint] = self._round
        return _Fetched(sample, taken_at, in_flight_at, None)

    async def _read(self, response: aiohttp.ClientResponse) -> bytes | None:
        if response.content_length is not None and response.content_length > self._max_bytes:
            return None
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.content.iter_chunked(64 * 1024):
            size += len(chunk)
            if size > self._max_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)


def _failed(reason: str) -> _Fetched:
    return _Fetched(None, 0.0, 0, reason)


def _outcome(task: asyncio.Task[_Fetched]) -> _Fetched:
    if not task.done() or task.cancelled():
        return _failed("budget")
    exc = task.exception()
    if exc is not None:
        log.warning("scrape task failed unexpectedly: %r", exc)
        return _failed("error")
    return task.result()
