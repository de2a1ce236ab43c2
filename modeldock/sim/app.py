"""The simulator's HTTP routes: the OpenAI API, /health, /metrics and the /sim/ test hooks."""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import struct
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from modeldock.clock import Clock
from modeldock.sim.config import SimConfig
from modeldock.sim.driver import Driver, Handle
from modeldock.sim.engine import Engine, TokenOut
from modeldock.sim.hooks import Fault, FaultPlan, RequestLog, parse_fault, read_json
from modeldock.sim.metrics import SimMetrics
from modeldock.sim.protocol import DONE_EVENT, ApiError, Choice, Job, Kind, Reply, parse_job

SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
# Paths not written to the request log: probes would push the requests tests look for out of it.
UNLOGGED_PATHS = ("/health", "/metrics")
# Before cutting a stream on purpose, give the chunks already written time to leave.
DRAIN_BEFORE_RESET_S = 0.01
MAX_BODY_BYTES = 64 * 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A request's sequences by engine id: the choice each serves and its driver handle.
Handles = dict[str, tuple[Choice, Handle]]


class SimApp:
    def __init__(self, config: SimConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self.engine = Engine(config)
        self.metrics = SimMetrics(config)
        self.driver = Driver(self.engine, self.metrics, clock, config.speed)
        self.faults = FaultPlan()
        self.requests = RequestLog()
        self.received = 0
        # Long prompts are legitimate here; the gateway in front enforces body limits.
        middlewares = [self._log_requests] + ([self._check_api_key] if config.api_key else [])
        self.app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY_BYTES)
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat),
                web.post("/v1/completions", self.completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics_text),
                web.get("/sim/requests", self.sim_requests),
                web.delete("/sim/requests", self.sim_clear_requests),
                web.get("/sim/stats", self.sim_stats),
                web.get("/sim/fault", self.sim_get_fault),
                web.post("/sim/fault", self.sim_fault),
                web.post("/sim/slow", self.sim_slow),
                web.post("/sim/speed", self.sim_speed),
            ]
        )

    @web.middleware
    async def _log_requests(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not request.path.startswith("/sim/") and request.path not in UNLOGGED_PATHS:
            await self.requests.record(request, self.clock.time())
        return await handler(request)

    @web.middleware
    async def _check_api_key(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # vLLM's --api-key: every /v1 route, a 401 with this body otherwise.
        if request.path.startswith("/v1"):
            expected = f"Bearer {self.config.api_key}".encode()
            if not hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    # --- OpenAI API -------------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, "completion")

    async def _infer(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        self.received += 1
        fault = self.faults.take()
        if fault.mode == "status_503":
            return _error(ApiError(503, "The server is temporarily unavailable (injected).", "ServiceUnavailableError"))
        if fault.mode == "reset_before_headers":
            _reset(request)
            return web.Response()  # never sent: the connection is gone
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            return _error(ApiError(400, f"Invalid JSON body: {exc}", "BadRequestError"))
        try:
            job = parse_job(kind, body, self.config)
        except ApiError as exc:
            return _error(exc)

        request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        reply = Reply(job, request_id, self.config.model, int(self.clock.time()))
        # Each (prompt, sample) pair is its own sequence in the engine, as vLLM fans a request out, so
        # batching, KV and the token counters see every one; their tokens come back on one queue.
        queue: asyncio.Queue[TokenOut | None] = asyncio.Queue()
        handles: dict[str, tuple[Choice, Handle]] = {}
        try:
            for k, choice in enumerate(job.choices):
                sequence_id = request_id if len(job.choices) == 1 else f"{request_id}-{k}"
                handle = self.driver.submit(sequence_id, choice.prompt, choice.max_tokens, choice.finish_reason,
                                            queue)
                handles[sequence_id] = (choice, handle)
            if job.stream:
                return await self._stream(request, job, reply, handles, queue, fault)
            return await self._whole(request, reply, handles, queue, fault)
        except ConnectionError:
            # A write found the client gone. Not an error worth a traceback in the log;
            # aiohttp fails to send this placeholder and drops the connection quietly.
            return web.Response()
        finally:
            # Client gone (handler cancelled or a write failed), a fault, or shutdown.
            now = self.clock.monotonic()
            for _, handle in handles.values():
                if not handle.done:
                    self.driver.cancel(handle, now)

    async def _whole(self, request: web.Request, reply: Reply, handles: Handles,
                     queue: asyncio.Queue[TokenOut | None], fault: Fault) -> web.StreamResponse:
        while not all(handle.done for _, handle in handles.values()):
            if await queue.get() is None:
                _reset(request)
                return web.Response()
        if fault.mode == "die_after_chunks":
            # A non-streaming reply has no chunks: the connection dies before the answer.
            _reset(request)
            return web.Response()
        outputs = [(handle.num_output, handle.finish_reason or "abort")
                   for choice, handle in handles.values() if choice.returned]
        return web.json_response(reply.full(outputs))

    async def _stream(self, request: web.Request, job: Job, reply: Reply, handles: Handles,
                      queue: asyncio.Queue[TokenOut | None], fault: Fault) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        budget = fault.chunks if fault.mode == "die_after_chunks" else None
        sent = 0
        unfinished = len(handles)
        while True:
            item = await queue.get()
            events: list[bytes] = []
            # Write every token already waiting in one go: one syscall, several SSE events.
            while True:
                if item is None:  # shutting down
                    _reset(request)
                    return response
                choice, _ = handles[item.request_id]
                if choice.returned:  # best_of's extra samples are generated, never sent
                    if item.index == 0 and job.kind == "chat":
                        events.append(reply.role_event(choice.index))
                    events.append(reply.token_event(item.index, item.finish_reason, choice))
                if item.finish_reason is not None:
                    unfinished -= 1
                if unfinished == 0 or queue.empty():
                    break
                item = queue.get_nowait()
            finished = unfinished == 0
            if finished:
                if job.include_usage:
                    completion = sum(handle.num_output for choice, handle in handles.values() if choice.returned)
                    events.append(reply.usage_event(completion))
                events.append(DONE_EVENT)
            if budget is not None and (finished or sent + len(events) >= budget):
                sendable = events[:-1] if finished else events  # never the [DONE]
                keep = sendable[: max(0, budget - sent)]
                if keep:
                    await response.write(b"".join(keep))
                await asyncio.sleep(DRAIN_BEFORE_RESET_S)
                _reset(request)
                return response
            if events:
                await response.write(b"".join(events))
            sent += len(events)
            if finished:
                await response.write_eof()
                return response

    async def models(self, request: web.Request) -> web.StreamResponse:
        model = self.config.model
        card = {
            "id": model,
            "object": "model",
            "created": int(self.clock.time()),
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": self.config.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.Response()

    async def metrics_text(self, request: web.Request) -> web.StreamResponse:
        body = self.metrics.render(self.engine)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # --- test hooks ---------------------------------------------------------------------

    async def sim_requests(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.requests.entries())

    async def sim_clear_requests(self, request: web.Request) -> web.StreamResponse:
        self.requests.clear()
        return web.json_response({"cleared": True})

    async def sim_stats(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.stats())

    def stats(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "completed": engine.completed,
            "cancelled": engine.cancelled,
            "last_cancel_latency_ms": self.driver.last_cancel_latency_ms,
            "received": self.received,
            "preemptions": engine.preemptions,
            "kv_cache_usage": engine.kv_usage,
            "prefix_cache_queries": engine.prefix_queries,
            "prefix_cache_hits": engine.prefix_hits,
            "steps": engine.steps,
            "sim_time_s": engine.sim_time,
        }

    async def sim_get_fault(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.faults.describe())

    async def sim_fault(self, request: web.Request) -> web.StreamResponse:
        try:
            fault, count = parse_fault(await read_json(request))
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        self.faults.set(fault, count)
        return web.json_response(self.faults.describe())

    async def sim_slow(self, request: web.Request) -> web.StreamResponse:
        body = await read_json(request)
        extra = body.get("extra_step_ms") if isinstance(body, dict) else None
        if isinstance(extra, bool) or not isinstance(extra, (int, float)) or extra < 0:
            return web.json_response({"error": "extra_step_ms must be a non-negative number"}, status=400)
        self.driver.extra_step_s = extra / 1000.0
        return web.json_response({"extra_step_ms": extra})

    async def sim_speed(self, request: web.Request) -> web.StreamResponse:
        # Changes the time factor while running, e.g. 0.5 for a half-speed backend in a benchmark.
        body = await read_json(request)
        speed = body.get("speed") if isinstance(body, dict) else None
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 < speed < float("inf"):
            return web.json_response({"error": "speed must be a positive number"}, status=400)
        self.driver.speed = float(speed)
        return web.json_response({"speed": speed})


def _error(exc: ApiError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


def _reset(request: web.Request) -> None:
    """Drop the connection with a TCP RST, as a crashing server would."""
    transport = request.transport
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # Linger on, timeout 0: close() sends RST instead of FIN.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
