"""The overload benchmark's client over several replicas, and the two phases that need more than one:
a replica killed mid-run (`kill`) and Redis stopped mid-run (`redis_down`).

The client sends every tenant's seeded schedule open loop, each request through the replica its route
names (round robin over the arrivals, or one fixed replica per tenant) and, when that replica is down,
through the next live one (`plan.route`): its clients fail over to the survivors. Events (a kill, a
Redis stop or start) run in a thread at their offset from the schedule's start, and a sampler thread
reads counters every `interval` s while the phase runs.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import aiohttp

from benchmarks.overload import plan
from benchmarks.overload.plan import Tenant
from benchmarks.routing.driver import Timed
from benchmarks.routing.workloads import Request
from modeldock.bench.metrics import RequestRecord, StreamObserver
from modeldock.bench.runner import stream_request

# A tenant's schedule and its route: None = round robin over the replicas, i = through replica i.
Plan = tuple[Tenant, Sequence[Request], int | None]
PEERS = "modeldock_sharing_peers"


@dataclass
class Sent:
    tenant: str
    replica: int  # the replica it was sent through
    timed: Timed


@dataclass
class Event:
    at: float  # seconds after the schedule's start
    name: str
    action: Callable[[], object]
    done_at: float | None = None  # seconds after the start when the action returned


async def open_loop(urls: Sequence[str], live: list[bool], plans: Sequence[Plan], timeout: float,
                    events: Sequence[Event] = ()) -> tuple[float, list[Sent]]:
    """Every plan's requests at their planned offsets; returns the start (perf_counter) and what came of
    each request. `live[i]` False: replica i is down, its arrivals go to the next live one."""
    start = perf_counter() + 0.3  # every tenant on one schedule
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:

        async def one(tenant: Tenant, n: int, request: Request, fixed: int | None) -> Sent:
            planned = start + request.at
            if (delay := planned - perf_counter()) > 0:
                await asyncio.sleep(delay)
            replica = plan.route(n if fixed is None else fixed, live)
            headers = {"Content-Type": "application/json", "Accept": "text/event-stream",
                       "Accept-Encoding": "identity", "Authorization": f"Bearer {tenant.key}"}
            record = RequestRecord(index=request.index, sent_at=perf_counter())
            body = json.dumps(request.body(plan.MODEL)).encode()
            await stream_request(session, urls[replica].rstrip("/") + "/chat/completions", headers, body,
                                 StreamObserver(record, "chat", use_usage=True), timeout)
            return Sent(tenant.id, replica, Timed(request, record, record.sent_at - planned, perf_counter()))

        async def fire(event: Event) -> None:
            if (delay := start + event.at - perf_counter()) > 0:
                await asyncio.sleep(delay)
            await loop.run_in_executor(None, event.action)
            event.done_at = perf_counter() - start

        sends = [one(t, n, r, fixed) for t, reqs, fixed in plans for n, r in enumerate(reqs)]
        results = await asyncio.gather(*sends, *(fire(e) for e in events))
    return start, [r for r in results if isinstance(r, Sent)]


class Sampler:
    """Reads `read()` every `interval` s in a thread, as (seconds since `origin`, value) pairs."""

    def __init__(self, read: Callable[[], Any], interval: float) -> None:
        self.read, self.interval = read, interval
        self.samples: list[tuple[float, Any]] = []
        self.origin = perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                value = self.read()
            except OSError:  # a replica going down mid-read: no sample this round
                value = None
            self.samples.append((perf_counter() - self.origin, value))
            self._stop.wait(self.interval)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def since(self, start: float) -> list[tuple[float, Any]]:
        """The samples with times from the perf_counter() instant `start`."""
        return [(t + self.origin - start, v) for t, v in self.samples]


def gauge(port: int, name: str) -> float | None:
    """A metric's summed samples from a /metrics endpoint; None if it exports no such metric."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()  # noqa: S310
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{")]
    return sum(values) if values else None


def failed(sent: Sequence[Sent]) -> int:
    """Requests that did not complete, a 429 (the gateway shedding, counted apart) not included."""
    return sum(1 for s in sent if s.timed.record.error not in (None, "429"))


def shed(sent: Sequence[Sent]) -> int:
    return sum(1 for s in sent if s.timed.record.error == "429")


def kill_summary(sent: Sequence[Sent], victim: int, kill_at: float, killed_at: float,
                 pre: Sequence[tuple[float, float]], after_s: float) -> dict[str, Any]:
    """What the kill did: requests that failed on the killed replica (sent before it went), the others'
    failures and 429s, and the preemptions over `after_s` s after it against as long before it."""
    at_kill = [s for s in sent if s.replica == victim and s.timed.request.at < killed_at]
    mine = {id(s) for s in at_kill}
    rest = [s for s in sent if id(s) not in mine]
    return {
        "victim": victim, "kill_at_s": kill_at, "killed_at_s": killed_at, "after_s": after_s,
        "failed_at_kill": failed(at_kill), "sent_to_victim_before": len(at_kill), "failed_other": failed(rest),
        "r429_other": shed(rest),
        "preemptions_after": plan.counter_between(pre, kill_at, kill_at + after_s),
        "preemptions_before": plan.counter_between(pre, max(0.0, kill_at - after_s), kill_at),
    }
