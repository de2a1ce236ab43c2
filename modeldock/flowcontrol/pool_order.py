"""Which replica's queued request takes the pool's room first.

With several replicas each holds its own queue, but the room is the pool's (modeldock/sharing). When
room appears, the replica that sees it first would dispatch its own head, though a peer may hold a
request that waited longer: the flood's requests on one replica would pass the quiet tenant's on the
other, and the pool's FIFO within a tenant would be lost (a long tail of waits on the replica whose
releases come later). So a queued request here yields the room to a peer's flow head that one queue
would serve first:

- any head of a higher class;
- an older head of its own tenant in its class (FIFO within a tenant, pool-wide);
- an older head of another tenant in its class, unless this request is protected (under its share:
  the room it takes is owed to it, as in one queue's `dispatch`).

As one queue backfills, a peer head larger than this request (it may not fit where this one does) is
passed while it has waited less than `queue.backfill_seconds`; past that it is not (no starving).

It yields for at most `hold_seconds` (then takes the room: a peer whose head cannot use it, or that
did not hear of it, never stalls this queue), and is tried again at that bound. The peer hears of the
room within a push (the release that made it is pushed to every replica at once), so the room stays
idle for about one Redis hop, not for the hold. A new request with such a peer head joins the queue
here rather than taking room at once (the fast path is for nobody waiting in the pool).

Heads' ages come with the peers' shares (`QueuedFlow.waited`, aged on by the transport to when it
applied them); estimates good to a few milliseconds, so heads closer than `SLACK_SECONDS` are equal
and nobody yields.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from modeldock.clock import Clock
from modeldock.flowcontrol.item import Item
from modeldock.flowcontrol.queue_share import QueuedFlow

HOLD_SECONDS = 0.05  # a few pushes' worth: the peer hears of the room in one
SLACK_SECONDS = 0.005

T = TypeVar("T")
CallLater = Callable[[float, Callable[[], None]], object]


def peer_first(flows: Iterable[QueuedFlow], tenant: str, priority: int, enqueued_at: float,
               applied_at: float, protected: bool, cost: int = 0, backfill_seconds: float = 0.0,
               now: float = 0.0) -> bool:
    """Would one queue serve one of these peer flow heads before a request of `tenant` in class
    `priority`, of `cost` tokens, that was queued at `enqueued_at`? (`applied_at`: when the flows'
    `waited` held.) As one queue backfills, a head larger than this request (it may not fit where
    this one does) is passed while it has waited less than `backfill_seconds` (at `now`)."""
    for flow in flows:
        head_at = applied_at - flow.waited
        if flow.head > cost and now - head_at < backfill_seconds:
            continue  # larger, and not waiting long enough that it must not be passed
        if flow.priority > priority:
            return True
        if flow.priority == priority and (flow.tenant == tenant or not protected):
            if head_at < enqueued_at - SLACK_SECONDS:
                return True
    return False


class PoolOrder:
    """The peers' queued flows as this replica last heard them, and the yielding rule above."""

    def __init__(self, clock: Clock, retry: Callable[[str], None], *, call_later: CallLater | None = None,
                 hold_seconds: float = HOLD_SECONDS, backfill_seconds: float = 0.0) -> None:
        """`retry(model)`: dispatch the model's queue again (a yield's bound passed, or the peers'
        queues changed)."""
        self._clock = clock
        self._retry = retry
        self._call_later = call_later
        self.hold = hold_seconds
        self.backfill = backfill_seconds  # queue.backfill_seconds: how long a larger head may be passed
        self._flows: Mapping[str, tuple[QueuedFlow, ...]] = {}
        self._applied_at = 0.0
        self._yielding: set[str] = set()  # models with a request that yielded since the last retry
        self._timers: dict[str, float] = {}  # model -> when its retry is due

    def apply(self, by_model: Mapping[str, tuple[QueuedFlow, ...]]) -> None:
        """The peers' flows now (their heads' `waited` as of now). A model whose requests yielded is
        tried again once the caller's current step is over (the holdings that came with these
        flows are applied by then)."""
        self._flows = by_model
        self._applied_at = self._clock.monotonic()
        if self._yielding:
            models, self._yielding = self._yielding, set()
            for model in models:
                self._later(0.0, model)

    def ahead(self, model: str, tenant: str, priority: int, protected: bool, cost: int) -> bool:
        """A new request would yield to a peer's head: it joins the queue here."""
        flows = self._flows.get(model)
        now = self._clock.monotonic()
        return flows is not None and peer_first(flows, tenant, priority, now, self._applied_at, protected, cost,
                                                self.backfill, now)

    def yields(self, model: str, item: Item[T], protected: bool) -> bool:
        """Leave the room `item` would take to an older peer head (and try it again at the bound)?"""
        flows = self._flows.get(model)
        if not flows:
            return False
        now = self._clock.monotonic()
        since = item.yielded_at
        if since is not None and now - since >= self.hold:
            return False
        if not peer_first(flows, item.tenant, item.priority, item.enqueued_at, self._applied_at, protected,
                          item.cost, self.backfill, now):
            return False
        if since is None:
            item.yielded_at = since = now
        self._yielding.add(model)
        self._later(since + self.hold - now, model)
        return True

    def _later(self, delay: float, model: str) -> None:
        due = self._clock.monotonic() + delay
        pending = self._timers.get(model)
        if pending is not None and pending <= due:
            return  # an earlier retry will run (and set up the next one if still needed)
        self._timers[model] = due
        call_later = self._call_later or asyncio.get_running_loop().call_later
        call_later(max(0.0, delay), lambda: self._fire(model, due))

    def _fire(self, model: str, due: float) -> None:
        if self._timers.get(model) == due:
            del self._timers[model]
        self._retry(model)
