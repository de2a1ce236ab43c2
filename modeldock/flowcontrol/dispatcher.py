"""Flow control behind one call: `Dispatcher.acquire(waiting) -> Pick`.

The director hands each admitted request here and gets back an endpoint picked and counted, or a
Rejection; it never sees the queue. The dispatcher owns the model queues (`FlowQueues`) and the
tenants' standing (`Standing`), and decides the two things between them:

- *fairness*: a request is picked at once when nobody waits for its model, or when it is protected
  from those who wait (a lower class, a tenant over its share: the slots they must leave free are
  its own); otherwise it joins the model's queue (fair order), and `dispatch` hands queued requests
  their picks as room appears (the picker's room listener calls it);
- *headroom*: how much room a request must leave free on an endpoint for protected ones
  (`headroom`, from `Standing`), passed to the pick.

Plain typed Python, no I/O. The pick itself is a callable (`PickFn`, the Picker's `pick`), so the
dispatcher needs nothing of picking but the call and its `Saturated` refusal. Shared state across
replicas plugs in at `Standing` (who was served what lately) and at the drain rate (`speed`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from modeldock.clock import Clock
from modeldock.errors import Rejection
from modeldock.flowcontrol.config import QueueConfig
from modeldock.flowcontrol.item import Item
from modeldock.flowcontrol.metrics import QueueMetrics
from modeldock.flowcontrol.pool_order import CallLater, PoolOrder
from modeldock.flowcontrol.queue_share import QueuedFlow
from modeldock.flowcontrol.queues import FlowQueues
from modeldock.flowcontrol.standing import Standing
from modeldock.flowcontrol.waiting import Waiting
from modeldock.picking import Pick, Saturated
from modeldock.types import Endpoint

log = logging.getLogger("modeldock.flowcontrol")

Headroom = tuple[int, int | None]  # (slots, tokens) a request must leave free at an endpoint


class PickFn(Protocol):
    """Pick an endpoint and count the request on it, in one synchronous step (`Picker.pick`);
    raises `Saturated` when none has room."""

    def __call__(self, model: str, prefix: Sequence[int] = (), *, cost: int = 0,
                 subset: frozenset[Endpoint] | None = None, headroom: int = 0,
                 headroom_tokens: int | None = None, prefer_fast: bool = False,
                 output: int | None = None) -> Pick: ...


def _release(pick: Pick) -> None:
    """A pick the queue made for a waiter that was cancelled in the same instant."""
    pick.lease.release()


class Dispatcher:
    def __init__(self, config: QueueConfig, clock: Clock, *, pick: PickFn, speed: Callable[[str], float],
                 metrics: QueueMetrics | None = None, call_later: CallLater | None = None) -> None:
        """`pick`: the picker's pick-and-count; `speed(model)`: tokens/second the model's endpoints
        process together (the queues' drain budget); `call_later`: the loop's (tests inject one)."""
        self.config = config
        self._clock = clock
        self.pick_and_count = pick  # public: a test may stand in for the picker
        self.queues: FlowQueues[Pick] = FlowQueues(config, clock, release=_release, metrics=metrics,
                                                   drain_rate=speed)
        self.standing = Standing(clock, config.headroom_window_seconds, config.share_window_seconds)
        self._dispatching = False
        self._again: set[str] = set()
        self.order = PoolOrder(clock, self.dispatch, call_later=call_later,  # the peers' heads (several replicas)
                               backfill_seconds=config.backfill_seconds)

    def flows(self) -> tuple[QueuedFlow, ...]:
        """Every model's queued flows here, for the peers (modeldock/sharing)."""
        return tuple(flow for queue in self.queues for flow in queue.flows())

    def apply_peer_flows(self, flows: Iterable[QueuedFlow]) -> None:
        """The peers' queued flows (all of them, after an exchange; none: the local view): each
        model's queue counts them in its drain budget."""
        grouped: dict[str, list[QueuedFlow]] = {}
        for flow in flows:
            grouped.setdefault(flow.model, []).append(flow)
        by_model = {model: tuple(peer) for model, peer in grouped.items()}
        now = self._clock.monotonic()
        for queue in self.queues:
            queue.peer_flows, queue.peer_at = by_model.get(queue.model, ()), now
        for model, peer in by_model.items():  # a model queued only elsewhere: its queue here knows it
            queue = self.queues.get(model)
            queue.peer_flows, queue.peer_at = peer, now
        self.order.apply(by_model)

    async def acquire(self, request: Waiting) -> Pick:
        """An endpoint for `request`, picked and counted: at once when there is room and nobody waits
        (the usual path: one pick), else after a wait in its model's queue. Raises the pick's or the
        queue's Rejection (429 queue_full / queue_timeout, or Saturated with the queue off), or
        CancelledError when the caller goes; nothing is held when it raises."""
        model, tenant, weight = request.model, request.tenant, request.weight
        priority = self.config.priority(request.klass or self.config.default_class)
        self.standing.seen(model, tenant, weight, priority)
        queue = self.queues.waiting(model)
        headroom = self.headroom(model, tenant, weight, priority)
        if headroom is None:
            self.standing.protected(model, request.cost)
        # Nobody waits, or this request is protected from those who wait: the slots they leave free
        # are its own, so it takes one at once rather than queue behind one that may not take it.
        fast = self._prefer_fast(model, tenant, priority, headroom)
        # Nobody waits here, but a peer's head would be served first: wait behind it (pool_order.py).
        yields = (queue is None and self.config.enabled
                  and self.order.ahead(model, tenant, priority, headroom is None, request.cost))
        if (queue is None and not yields) or fast:
            try:
                return self._picked(request, headroom, fast)
            except Saturated:
                if not self.config.enabled:
                    raise
        behind = queue is not None or yields  # others wait: join them (fair order), then let dispatch decide
        queue = self.queues.get(model)
        item = queue.enqueue(request, protected=self._passes(headroom))
        if behind:
            self.dispatch(model)
        klass = item.klass
        try:
            pick = await queue.wait(item)
        except Rejection as rejection:
            rejection.detail = (f"{rejection.detail}; " if rejection.detail else "") + (
                f"waited {self._clock.monotonic() - item.enqueued_at:.3f}s in the queue (class {klass})")
            raise
        except asyncio.CancelledError:
            log.info("request %s left the queue of model %s after %.3fs: the client went away (tenant=%s class=%s)",
                     request.request_id or "-", model, self._clock.monotonic() - item.enqueued_at, tenant, klass)
            raise
        log.info("request %s waited %.3fs in the queue of model %s (tenant=%s class=%s cost=%d) -> %s",
                 request.request_id or "-", self._clock.monotonic() - item.enqueued_at, model, tenant, klass,
                 request.cost, pick.primary.address)
        return pick

    def dispatch(self, model: str) -> None:
        """Room may have appeared for `model` (the picker's room listener): hand queued requests
        their picks while there is room. Synchronous, no I/O; a call made while dispatching (a
        release inside a claim) runs after the current one."""
        if self.queues.waiting(model) is None:
            return
        if self._dispatching:
            self._again.add(model)
            return
        self._dispatching = True
        try:
            pending = {model}
            while pending:
                queue = self.queues.waiting(pending.pop())
                if queue is not None:
                    queue.dispatch(self._claim, self._protected)
                pending |= self._again
                self._again.clear()
        finally:
            self._dispatching = False

    def headroom(self, model: str, tenant: str, weight: float, priority: int) -> Headroom | None:
        """The slots and tokens a request must leave free at an endpoint (a class above it active, or
        its tenant over its share: standing.py), or None (protected, or headroom off). Only
        with the queue on: headroom is what it keeps free."""
        config = self.config
        if not config.enabled or not (config.headroom or config.headroom_tokens):
            return None
        if not self.standing.must_leave_headroom(model, tenant, weight, priority):
            return None
        kept = config.headroom_tokens
        if kept is None:  # each kept slot sized to the protected requests seen lately (standing.py)
            one = self.standing.kept_tokens(model)
            kept = None if one is None else one * config.headroom
        return config.headroom, kept

    # -- the queue's callbacks ----------------------------------------------------------------

    def _claim(self, item: Item[Pick]) -> Pick | None:
        """Pick and count for a queued request, or None: still no room."""
        request = item.request
        headroom = self.headroom(request.model, item.tenant, item.weight, item.priority)
        if self.order.yields(request.model, item, headroom is None):
            return None  # an older peer head takes this room first (it hears of it by the push)
        try:
            return self._picked(request, headroom, self._prefer_fast(request.model, item.tenant, item.priority,
                                                                     headroom))
        except Saturated:
            return None

    def _protected(self, item: Item[Pick]) -> bool:
        """May a queued request use the headroom (the queue then tries it past a head that may not)?"""
        return self.headroom(item.request.model, item.tenant, item.weight, item.priority) is None

    # -- the decisions ------------------------------------------------------------------------

    def _picked(self, request: Waiting, headroom: Headroom | None, fast: bool) -> Pick:
        slots, tokens = headroom or (0, None)
        pick = self.pick_and_count(request.model, request.prefix, cost=request.cost, subset=request.subset,
                                   prefer_fast=fast, output=request.output, headroom=slots, headroom_tokens=tokens)
        self.standing.served(request.model, request.tenant, request.cost, request.weight)
        return pick

    def _passes(self, headroom: Headroom | None) -> bool:
        """Will a queued request with this headroom be tried past heads that must leave room?"""
        return headroom is None and bool(self.config.headroom or self.config.headroom_tokens)

    def _prefer_fast(self, model: str, tenant: str, priority: int, headroom: Headroom | None) -> bool:
        """A protected request while others on the model must leave it room (headroom on)."""
        return (headroom is None and bool(self.config.headroom)
                and self.standing.contended(model, tenant, priority))
