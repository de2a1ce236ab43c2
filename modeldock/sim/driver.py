"""Runs the engine in real time: one step, sleep for its duration / speed, hand out the tokens.

Each request's tokens go to its own asyncio.Queue; the HTTP handler reads it. Latency
histograms are recorded here, on the server's wall clock, at the moment tokens are
handed out, which is when a streaming client can first see them.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from modeldock.clock import Clock
from modeldock.sim.engine import Engine, StepResult, TokenOut
from modeldock.sim.metrics import SimMetrics
from modeldock.sim.tokens import Prompt

# If the event loop stalls for longer than this, restart the schedule instead of
# running the missed steps back to back.
MAX_LAG_S = 0.05


@dataclass(eq=False)
class Handle:
    """One request as the HTTP side sees it."""

    request_id: str
    prompt_tokens: int
    arrival: float
    # Items are tokens, or None when the simulator shuts down under the request.
    queue: asyncio.Queue[TokenOut | None] = field(default_factory=asyncio.Queue)
    admitted_at: float | None = None
    last_token_at: float | None = None
    num_output: int = 0
    finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Driver:
    def __init__(self, engine: Engine, metrics: SimMetrics, clock: Clock, speed: float) -> None:
        self.engine = engine
        self.metrics = metrics
        self.clock = clock
        self.speed = speed
        self.extra_step_s = 0.0  # real seconds added to every step (the /sim/slow knob)
        self.last_cancel_latency_ms: float | None = None
        self._handles: dict[str, Handle] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="modeldock-sim-driver")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for handle in self._handles.values():
            handle.queue.put_nowait(None)

    def submit(self, request_id: str, prompt: Prompt, max_tokens: int, finish_reason: str,
               queue: asyncio.Queue[TokenOut | None] | None = None) -> Handle:
        """One sequence into the engine; its tokens go to `queue` (shared by a request's choices) or its own."""
        handle = Handle(request_id, prompt.num_tokens, self.clock.monotonic())
        if queue is not None:
            handle.queue = queue
        self.engine.add(request_id, prompt.num_tokens, max_tokens, prompt.block_hashes, finish_reason)
        self._handles[request_id] = handle
        self._wake.set()
        return handle

    def cancel(self, handle: Handle, detected_at: float) -> None:
        """The client went away: free the request in the engine now."""
        if self._handles.pop(handle.request_id, None) is None:
            return
        if self.engine.abort(handle.request_id):
            self.last_cancel_latency_ms = (self.clock.monotonic() - detected_at) * 1000.0
            self.metrics.success["abort"].inc()
        self._wake.set()

    async def _loop(self) -> None:
        deadline = self.clock.monotonic()
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                deadline = self.clock.monotonic()
            step = self.engine.step()
            self.metrics.record_step(step)
            if step.num_scheduled == 0:
                if not step.preempted:
                    # Nothing fits now; only an arrival or a cancel can change that.
                    self._wake.clear()
                    await self._wake.wait()
                deadline = self.clock.monotonic()
                continue
            deadline += step.duration_s / self.speed + self.extra_step_s
            delay = deadline - self.clock.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                if delay < -MAX_LAG_S:
                    deadline = self.clock.monotonic()
                await asyncio.sleep(0)  # let the handlers write what they have
            self._deliver(step)

    def _deliver(self, step: StepResult) -> None:
        now = self.clock.monotonic()
        metrics = self.metrics
        handles = self._handles
        for request_id in step.admitted:
            handle = handles.get(request_id)
            if handle is not None and handle.admitted_at is None:
                handle.admitted_at = now
                metrics.queue_time.observe(now - handle.arrival)
        for out in step.outputs:
            if out.finish_reason is not None:
                metrics.success[out.finish_reason].inc()
            handle = handles.get(out.request_id)
            if handle is None:
                continue  # cancelled while the step ran
            if handle.last_token_at is None:
                metrics.ttft.observe(now - handle.arrival)
            else:
                gap = now - handle.last_token_at
                metrics.itl.observe(gap)
                metrics.tpot.observe(gap)
            handle.last_token_at = now
            handle.num_output += 1
            if out.finish_reason is not None:
                handle.finish_reason = out.finish_reason
                del handles[out.request_id]
                metrics.e2e.observe(now - handle.arrival)
                metrics.request_prompt_tokens.observe(handle.prompt_tokens)
                metrics.request_generation_tokens.observe(handle.num_output)
            handle.queue.put_nowait(out)
