"""Open-loop driver: sends a workload's requests at their planned times and times each one.

`modeldock.bench.run_benchmark` is a closed loop with one prompt shape per tier, so this driver is
built on the bench package's pure pieces instead: `modeldock.bench.sse.SSEParser` for the stream,
`modeldock.bench.metrics.RequestRecord` / `StreamObserver` for the timestamps and error kinds, and
`modeldock.bench.metrics.ttft` / `e2e` plus `modeldock.bench.stats` for the numbers. So every
figure has exactly the bench tool's semantics (README of modeldock/bench): TTFT = first SSE event
with non-empty content − send time, E2E = `[DONE]` − send time, both `perf_counter()` readings
taken when the bytes reach this process; failures are counted by kind and kept out of latencies.

The only difference from the bench client is the schedule: request i is sent at
`start + at_i / speed` whatever happened to earlier ones (no concurrency cap), and `late_s` records
how far behind its planned time it really went out (a health check of the client itself).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter

import aiohttp

from benchmarks.routing.workloads import Request
from modeldock.bench.metrics import RequestRecord, StreamObserver, e2e, ttft
from modeldock.bench.runner import stream_request


@dataclass
class Timed:
    request: Request
    record: RequestRecord
    late_s: float  # actual send time − planned send time
    done_at: float  # perf_counter() when the request was over, completed or not

    @property
    def ttft(self) -> float | None:
        return ttft(self.record)

    @property
    def e2e(self) -> float | None:
        return e2e(self.record)


@dataclass
class DriveResult:
    timed: list[Timed]  # every request sent, warm-up ones included
    wall_s: float  # first measured planned send to the last measured request's end


async def drive(url: str, model: str, token: str | None, requests: Sequence[Request], speed: float,
                *, timeout: float = 120.0, start_at: float | None = None) -> DriveResult:
    """Send `requests` open-loop to `url` (a base URL ending in /v1). `start_at` is a perf_counter()
    time to start at (default: now + 0.2 s, so every body is built before the first send)."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream", "Accept-Encoding": "identity"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    endpoint = url.rstrip("/") + "/chat/completions"
    bodies = [json.dumps(r.body(model)).encode() for r in requests]
    connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue in the pool
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = start_at if start_at is not None else perf_counter() + 0.2

        async def one(request: Request, body: bytes) -> Timed:
            planned = start + request.at / speed
            delay = planned - perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            record = RequestRecord(index=request.index, sent_at=perf_counter())
            late = record.sent_at - planned
            await _send(session, endpoint, headers, body, record, timeout)
            return Timed(request, record, late, perf_counter())

        timed = await asyncio.gather(*(one(r, b) for r, b in zip(requests, bodies, strict=True)))
    return DriveResult(list(timed), measured_wall(timed, start, speed))


def measured_wall(timed: Sequence[Timed], start: float, speed: float) -> float:
    """From the first measured request's planned send to the last measured request's end."""
    measured = [t for t in timed if t.request.measured]
    if not measured:
        return 0.0
    first = start + min(t.request.at for t in measured) / speed
    return max(t.record.ended_at if t.record.ended_at is not None else t.done_at for t in measured) - first


async def _send(session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes,
                record: RequestRecord, timeout: float) -> None:
    """One streaming request, exactly as `modeldock bench` sends and measures it."""
    await stream_request(session, url, headers, body, StreamObserver(record, "chat", use_usage=True), timeout)
