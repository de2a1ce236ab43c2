"""The load generator: a fixed pool of workers streaming requests over one session.

Each tier runs its warmup requests, waits for them all, then runs its measured
requests. `concurrency` workers pull request numbers from a queue, so at most
`concurrency` requests are in flight and a worker sends its next request as
soon as its previous one ends (a closed loop). Timestamps are perf_counter()
readings taken when a byte chunk reaches this process; serializing the request
body happens before the send timestamp so it is not counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from time import perf_counter
from typing import Any, Literal

import aiohttp

from modeldock.bench.metrics import (
    INVALID,
    TIMEOUT,
    TRANSPORT,
    TRUNCATED,
    RequestRecord,
    StreamObserver,
)
from modeldock.bench.prompt import build_prompt
from modeldock.bench.results import BenchOptions, BenchResult, TierParams, TierResult, tier_result
from modeldock.bench.sse import SSEParser

# After [DONE], wait this long at most for the end of the HTTP body so the
# connection can be reused; it is not part of any measured time.
_DRAIN_SECONDS = 0.1
_ERROR_BODY_BYTES = 300

BenchPhase = Literal["warmup", "measure"]


@dataclass(frozen=True)
class Progress:
    concurrency: int
    phase: BenchPhase
    done: int
    total: int
    errors: int


ProgressCallback = Callable[[Progress], None]


async def run_benchmark(options: BenchOptions, progress: ProgressCallback | None = None) -> BenchResult:
    """Run every concurrency tier in order and return their results."""
    started_at = _utc_now()
    # The pool must never be the bottleneck: allow as many connections as workers.
    connector = aiohttp.TCPConnector(limit=max(options.concurrency))
    # Per-request deadlines are enforced with asyncio.timeout, not the session.
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = _Client(session, options)
        tiers: list[TierResult] = []
        next_index = 0
        for concurrency in options.concurrency:
            tier_started = _utc_now()
            warmup = range(next_index, next_index + options.warmup)
            measured = range(warmup.stop, warmup.stop + options.requests)
            next_index = measured.stop
            if options.warmup:
                await _run_phase(client, concurrency, warmup, "warmup", progress)
            start = perf_counter()
            records = await _run_phase(client, concurrency, measured, "measure", progress)
            wall_time = perf_counter() - start
            params = TierParams.of(options, concurrency, tier_started)
            tiers.append(tier_result(params, records, wall_time))
    return BenchResult(started_at=started_at, tiers=tiers)


async def _run_phase(
    client: _Client,
    concurrency: int,
    indices: Iterable[int],
    phase: BenchPhase,
    progress: ProgressCallback | None,
) -> list[RequestRecord]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in indices:
        queue.put_nowait(index)
    total = queue.qsize()
    records: list[RequestRecord] = []
    errors = 0

    async def worker() -> None:
        nonlocal errors
        while True:
            try:
                index = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            record = await client.request(index)
            records.append(record)
            errors += 0 if record.completed else 1
            if progress is not None:
                progress(Progress(concurrency, phase, len(records), total, errors))

    async with asyncio.TaskGroup() as group:
        for n in range(concurrency):
            group.create_task(worker(), name=f"modeldock-bench-worker-{n}")
    return sorted(records, key=lambda r: r.index)


class _Client:
    """Sends one streaming request and records what happened."""

    def __init__(self, session: aiohttp.ClientSession, options: BenchOptions) -> None:
        self.session = session
        self.options = options
        path = "/chat/completions" if options.endpoint == "chat" else "/completions"
        self.url = options.url.rstrip("/") + path
        self.headers = {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            # A compressed stream can be held back by the compressor, delaying first bytes.
            "Accept-Encoding": "identity",
        }
        if options.token:
            self.headers["Authorization"] = f"Bearer {options.token}"

    def payload(self, index: int) -> dict[str, Any]:
        options = self.options
        prompt = build_prompt(options.prompt_tokens, index, shared=options.shared_prompt)
        body: dict[str, Any] = {"model": options.model, "max_tokens": options.max_tokens, "stream": True}
        if options.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if options.usage:
            body["stream_options"] = {"include_usage": True}
        return body

    async def request(self, index: int) -> RequestRecord:
        body = json.dumps(self.payload(index)).encode()
        record = RequestRecord(index=index, sent_at=perf_counter())
        observer = StreamObserver(record, self.options.endpoint, self.options.usage)
        await stream_request(self.session, self.url, self.headers, body, observer, self.options.timeout)
        return record


async def stream_request(session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes,
                         observer: StreamObserver, timeout: float) -> None:
    """POST one streaming request and record what it did into `observer.record`."""
    record = observer.record
    response: aiohttp.ClientResponse | None = None
    try:
        async with asyncio.timeout(timeout):
            response = await session.post(url, data=body, headers=headers)
            await _read(response, observer)
    except TimeoutError:
        record.fail(TIMEOUT, f"no end of stream within {timeout:g}s")
    except (aiohttp.ClientError, OSError) as exc:
        # Once a 200 stream has started, a broken connection cut the stream short.
        kind = TRUNCATED if response is not None else TRANSPORT
        record.fail(kind, f"{type(exc).__name__}: {exc}")
    finally:
        if response is not None:
            await _let_go(response, observer)


async def _read(response: aiohttp.ClientResponse, observer: StreamObserver) -> None:
    record = observer.record
    if response.status != 200:
        # Classify first: a body that fails to arrive must not hide the status.
        record.fail(str(response.status))
        record.detail = await _body_start(response)
        return
    content_type = response.headers.get("Content-Type", "text/event-stream")
    if not content_type.startswith("text/event-stream"):
        record.fail(INVALID, f"not an event stream: {content_type}")
        return
    parser = SSEParser()
    async for chunk in response.content.iter_any():
        at = perf_counter()
        for event in parser.feed(chunk):
            observer.on_event(event, at)
        if observer.finished:
            return
    observer.on_close()


async def _let_go(response: aiohttp.ClientResponse, observer: StreamObserver) -> None:
    if observer.done and observer.record.completed and not response.content.at_eof():
        # If the body does not end in time, release() closes the connection instead.
        with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError):
            await asyncio.wait_for(response.content.read(), _DRAIN_SECONDS)
    if observer.record.completed:
        response.release()
    else:
        response.close()


async def _body_start(response: aiohttp.ClientResponse) -> str:
    try:
        text = await response.content.read(_ERROR_BODY_BYTES)
    except (aiohttp.ClientError, OSError):
        return ""
    return text.decode("utf-8", errors="replace")


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
