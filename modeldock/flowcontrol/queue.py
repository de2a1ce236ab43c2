"""A per-model flow-control queue: requests wait here while every endpoint is full.

Priority bands first (a higher class always goes first and is shed last), then
start-time fair queueing over tenants by token cost (bands.py), then FIFO within
a tenant. Bounded by length (total and per tenant) and by a wait TTL.

Contract (see README.md, "Cancel and dispatch"): every item `enqueue` returns
ends exactly once -- dispatched, rejected or cancelled -- and its caller must
`await wait(item)` (or call `cancel(item)`). A claim that `dispatch` made for
an item whose waiter is cancelled before it resumes is handed to `release`,
so the caller's count is undone exactly once.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from modeldock.clock import Clock
from modeldock.errors import RateLimited, Rejection
from modeldock.flowcontrol.bands import Band
from modeldock.flowcontrol.config import QueueConfig
from modeldock.flowcontrol.item import Item, State
from modeldock.flowcontrol.metrics import QueueMetrics
from modeldock.flowcontrol.queue_share import QueuedFlow, peer_ahead
from modeldock.flowcontrol.waiting import Waiting

T = TypeVar("T")

QUEUE_FULL = "queue_full"
BACKFILL_SCAN = 16  # items behind a head that does not fit, looked at for one that does
BACKFILL_TRIES = 4  # claims (picks) tried among them per dispatch step
QUEUE_TIMEOUT = "queue_timeout"
# The drain budget applies once the oldest request queued has waited this share of
# queue.max_wait_seconds: evidence that the queue is not a burst that drains at once (its
# estimate counts each request's whole output limit, which real requests often stop short of).
# A whole max_wait let admitted requests wait up to twice it (overload TTFT p95 0.81-0.94 s
# against 0.76-0.79 s at a half, three runs and two; measured at 0.6x capacity, none shed).
SHED_AFTER = 0.5

__all__ = ["QUEUE_FULL", "QUEUE_TIMEOUT", "SHED_AFTER", "Counts", "FlowQueue", "Item", "State"]


@dataclass
class Counts:
    """Every enqueue call ends in exactly one of the last three, or is still queued."""

    offered: int = 0
    dispatched: int = 0
    rejected: int = 0
    cancelled: int = 0
    abandoned: int = 0  # dispatched, then handed back to `release` (a subset of dispatched)
    backfilled: int = 0  # dispatched past a head that did not fit (a subset of dispatched)


class FlowQueue(Generic[T]):
    def __init__(
        self,
        model: str,
        config: QueueConfig,
        clock: Clock,
        *,
        release: Callable[[T], None],
        metrics: QueueMetrics | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        drain_rate: Callable[[], float] | None = None,
        shed_after: float = SHED_AFTER,
    ) -> None:
        """`drain_rate`: tokens/second the model's endpoints process together (the ledger's rate), for
        the drain budget (`queue.max_wait_seconds`); None: no drain budget. `shed_after`: the share of
        `max_wait_seconds` the oldest item must have waited before the budget applies."""
        self.model = model
        self.config = config
        self._clock = clock
        self._release = release
        self._drain_rate = drain_rate
        self._shed_after = shed_after
        self._metrics = metrics or QueueMetrics(None)
        self._loop = loop
        self._bands: list[Band[T]] = []  # highest priority first
        self._by_priority: dict[int, Band[T]] = {}
        self._deadlines: list[tuple[float, int, Item[T]]] = []
        self._tenants: dict[str, int] = {}
        self._length = 0
        self._seq = 0
        self.counts = Counts()
        # The other replicas' queued flows of this model (set after each exchange; see queue_share.py).
        self.peer_flows: tuple[QueuedFlow, ...] = ()
        self.peer_at = 0.0  # when peer_flows' `waited` held (clock.monotonic)

    def __len__(self) -> int:
        return self._length

    def tenant_length(self, tenant: str) -> int:
        return self._tenants.get(tenant, 0)

    def next_deadline(self) -> float | None:
        """The earliest TTL deadline among queued items (clock.monotonic scale)."""
        while self._deadlines and self._deadlines[0][2].state is not State.QUEUED:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    # -- entering ---------------------------------------------------------------------------

    def enqueue(self, request: Waiting, *, ttl: float | None = None, protected: bool = False) -> Item[T]:
        """Queue a request, or raise RateLimited(queue_full) if it may not wait.

        When the queue is full, the victim is always the newest item of the tenant
        holding the most of the lowest class present (tokens queued there / weight):
        a new item of a higher class evicts it; of the same class, only if that is
        another tenant holding more than the new item's would with it (the flooding
        tenant is shed, not the one that arrives); otherwise the new item is refused.
        The drain budget: with `queue.max_wait_seconds` set and a drain rate known, refuse it too when
        the tokens that would be dispatched before it (`ahead`) would not drain within that wait, once
        the oldest item queued has waited `shed_after` of it (a queue that drains in time is a burst,
        not overload). `protected`: the item will be tried past unprotected heads (dispatch's
        `protected`), so in its own band only its own flow is ahead of it.
        ValueError for an unknown class or a weight <= 0.
        """
        tenant, cost, weight = request.tenant, request.cost, request.weight
        klass = request.klass or self.config.default_class
        priority = self.config.priority(klass)
        if not weight > 0:
            raise ValueError(f"tenant weight must be positive, got {weight}")
        self.counts.offered += 1
        self.expire()
        limit = self.config.max_per_tenant
        if limit is not None and self._tenants.get(tenant, 0) >= limit:
            raise self._refuse(tenant, klass, f"tenant {tenant!r} already has {limit} requests queued")
        max_wait = self.config.max_wait_seconds
        if (max_wait is not None and self._drain_rate is not None and (self._length or self.peer_flows)
                and self.pool_oldest_wait() >= max_wait * self._shed_after):
            speed = self._drain_rate()
            ahead = self.ahead(tenant, priority, weight, protected)
            if self.peer_flows:  # the pool drains the peers' queues too (queue_share.py)
                band = self._by_priority.get(priority)
                own = band.queued.get(tenant, 0) if band is not None else 0
                ahead += peer_ahead(self.peer_flows, tenant, priority, weight, float(own))
            if speed > 0 and ahead > speed * max_wait:
                raise self._refuse(tenant, klass, f"the requests queued ahead for model {self.model!r} would not "
                                                  f"drain within {max_wait:g}s")
        if self._length >= self.config.max_length:
            victim = self._victim(tenant, priority, cost / weight)
            if victim is None:
                raise self._refuse(tenant, klass, f"the queue for model {self.model!r} is full")
            self._remove(victim)
            self._reject(victim, self._rejection(QUEUE_FULL, f"the queue for model {self.model!r} is full"))
        now = self._clock.monotonic()
        loop = self._loop or asyncio.get_running_loop()
        self._seq += 1
        item: Item[T] = Item(
            request=request, tenant=tenant, klass=klass, priority=priority, cost=max(1, int(cost)),
            weight=float(weight), enqueued_at=now, deadline=now + (self.config.ttl_seconds if ttl is None else ttl),
            seq=self._seq, future=loop.create_future(),
        )
        self._band(priority).add(item)
        self._tenants[tenant] = self._tenants.get(tenant, 0) + 1
        self._length += 1
        heapq.heappush(self._deadlines, (item.deadline, item.seq, item))
        if len(self._deadlines) > 2 * self._length + 64:  # drop entries of items that already left
            self._deadlines = [e for e in self._deadlines if e[2].state is State.QUEUED]
            heapq.heapify(self._deadlines)
        self._metrics.queued(self.model, tenant, klass, 1)
        return item

    def oldest_wait(self) -> float:
        """How long the oldest item queued has waited (0 when empty). O(tenants waiting): each
        flow's head is its oldest."""
        heads = [flow[0].enqueued_at for band in self._bands for flow in band.flows.values()]
        return self._clock.monotonic() - min(heads) if heads else 0.0

    def pool_oldest_wait(self) -> float:
        """How long the oldest item queued here or on a peer has waited (the peers' heads as last
        heard, aged on since): the drain budget is the pool's, and so is the evidence of overload."""
        oldest = self.oldest_wait() if self._length else 0.0
        if self.peer_flows:
            since = self._clock.monotonic() - self.peer_at
            oldest = max(oldest, max(flow.waited for flow in self.peer_flows) + since)
        return oldest

    def _victim(self, tenant: str, priority: int, share: float) -> Item[T] | None:
        """What a new item of `tenant` (class `priority`, `share` = cost / weight) evicts from a
        full queue, if anything (enqueue's rule). One rule in every class: the victim is the
        newest item of the lowest class present's heaviest tenant (`Band.heaviest`), so a tenant
        within its share of that class is never shed while another is over it. A higher class
        always sheds it (priority); the same class only when the heaviest is another tenant that
        holds more than the new item's would with it; a lower class never."""
        lowest = next(band for band in reversed(self._bands) if band.length)
        if lowest.priority > priority:
            return None
        heaviest, held = lowest.heaviest()
        if lowest.priority == priority:
            mine = lowest.flows.get(tenant)
            if heaviest == tenant or held <= share + (lowest.queued[tenant] / mine[0].weight if mine else 0.0):
                return None
        return lowest.flows[heaviest][-1]

    def ahead(self, tenant: str, priority: int, weight: float = 1.0, protected: bool = False) -> float:
        """Tokens queued that would be dispatched before a new item of `tenant` at `priority`:
        all of every higher band's, and its fair-queueing predecessors in its own band (only its
        own flow's items when `protected`: it goes past the others' unprotected heads)."""
        total = 0.0
        for band in self._bands:
            if band.priority > priority:
                total += band.tokens
            elif band.priority == priority:
                total += band.queued.get(tenant, 0) if protected else band.ahead(tenant, weight)
        return total

    def flows(self) -> list[QueuedFlow]:
        """What waits here, per class and tenant, for the peers."""
        out = []
        now = self._clock.monotonic()
        for band in self._bands:
            for tenant, items in band.flows.items():
                if items:
                    out.append(QueuedFlow(self.model, band.priority, tenant, items[0].weight,
                                          band.queued.get(tenant, 0), now - items[0].enqueued_at, items[0].cost))
        return out

    def _band(self, priority: int) -> Band[T]:
        band = self._by_priority.get(priority)
        if band is None:
            band = self._by_priority[priority] = Band(priority)
            self._bands.append(band)
            self._bands.sort(key=lambda b: -b.priority)
        return band

    # -- waiting ----------------------------------------------------------------------------

    async def wait(self, item: Item[T]) -> T:
        """The claim dispatch made for `item`; raises its Rejection, or CancelledError.

        Times itself out at the item's deadline, so an item never outlives its TTL
        by more than the event loop's timer slack, even if nothing else happens.
        If the awaiting task is cancelled, the item leaves the queue at once; if it
        had been dispatched in the same instant, its claim goes to `release`.
        """
        fut = item.future
        try:
            while not fut.done():
                remaining = item.deadline - self._clock.monotonic()
                if remaining > 0:
                    await asyncio.wait((fut,), timeout=remaining)
                if not fut.done():
                    self.expire()
        except asyncio.CancelledError:
            self.cancel(item)
            raise
        claim = fut.result()  # raises the Rejection (or CancelledError after cancel())
        item.taken = True
        return claim

    def cancel(self, item: Item[T]) -> bool:
        """The waiter went away. True if that changed anything (removed, or claim released)."""
        if item.state is State.QUEUED:
            self._remove(item)
            item.state = State.CANCELLED
            item.future.cancel()
            self.counts.cancelled += 1
            self._metrics.on_cancel(self.model, item.tenant, item.klass)
            return True
        if item.state is State.DISPATCHED and not item.taken:
            item.taken = True
            self.counts.abandoned += 1
            self._metrics.on_abandon(self.model)
            assert item.claim is not None
            self._release(item.claim)
            return True
        return False

    # -- leaving ----------------------------------------------------------------------------

    def dispatch(self, claim: Callable[[Item[T]], T | None],
                 protected: Callable[[Item[T]], bool] | None = None) -> int:
        """Hand queued items to their waiters, in order, while `claim` finds room.

        `claim(item)` runs synchronously per item: it picks and counts (returning
        the claim, e.g. a lease) or returns None when there is no room, which stops
        dispatch, unless a smaller item behind it fits while it has waited less than
        `backfill_seconds` (`_backfill`): past that a large request is not passed, so
        smaller ones behind it cannot starve it. One exception, `protected`: when
        the head is not protected (it must leave headroom), the heads of the other
        tenants' flows in its band that are protected are tried first, in fair
        order: the room the head must leave is theirs, and any other room it would
        take is room they wait for (they are under their share). The class order
        holds; FIFO within a tenant, but for backfill.
        If `claim` raises a Rejection, that item leaves with it and dispatch goes
        on. `claim` must not call into this queue. Returns the number dispatched.
        """
        self.expire()
        dispatched = 0
        while self._length:
            item = self._head()
            if item.future.done():  # the caller cancelled the future itself: it is gone
                self.cancel(item)
                continue
            got = None
            if protected is not None and not protected(item):
                passed = self._past(item, claim, protected)
                if passed is not None:
                    item, got = passed
            if got is None:
                got = self._try(item, claim)
                if item.state is State.REJECTED:
                    continue
                if got is None:
                    passed = self._backfill(item, claim, protected)
                    if passed is None:
                        break
                    item, got = passed
                    self.counts.backfilled += 1
                    self._metrics.on_backfill(self.model, item.tenant, item.klass)
            self._remove(item, dispatched=True)
            item.state = State.DISPATCHED
            item.claim = got
            item.future.set_result(got)
            self.counts.dispatched += 1
            self._metrics.on_dispatch(self.model, item.tenant, item.klass, self._clock.monotonic() - item.enqueued_at)
            dispatched += 1
        return dispatched

    def _try(self, item: Item[T], claim: Callable[[Item[T]], T | None]) -> T | None:
        """`claim(item)`; an item whose claim raises a Rejection leaves the queue with it (its
        state is then REJECTED) and None is returned, as for no room."""
        try:
            return claim(item)
        except Rejection as exc:
            self._remove(item)
            self._reject(item, exc)
            return None

    def _past(self, head: Item[T], claim: Callable[[Item[T]], T | None],
              protected: Callable[[Item[T]], bool]) -> tuple[Item[T], T] | None:
        """The first protected flow head of `head`'s band, after it, that `claim` finds room for."""
        for item in self._by_priority[head.priority].heads():
            if item is head or item.tenant == head.tenant or item.future.done() or not protected(item):
                continue
            got = self._try(item, claim)  # rejected: the next item of its flow waits for the next dispatch
            if got is not None:
                return item, got
        return None

    def _backfill(self, head: Item[T], claim: Callable[[Item[T]], T | None],
                  protected: Callable[[Item[T]], bool] | None) -> tuple[Item[T], T] | None:
        """A smaller item behind `head` in its band that `claim` finds room for, while `head` has
        waited less than `backfill_seconds`: the room a head that does not fit leaves idle goes to
        requests that fit in it (a long generation at the head kept short ones behind it from
        free slots). At most BACKFILL_TRIES claims, over the first BACKFILL_SCAN items; an item
        no smaller than one refused is not tried, nor one of another tenant that is not
        `protected` when the head is (a tenant over its share does not take the room a tenant
        under it waits for). Past the limit the head blocks again, so it is not starved: room
        that frees then is its."""
        limit = self.config.backfill_seconds
        if limit <= 0 or self._clock.monotonic() - head.enqueued_at >= limit:
            return None
        guard = protected if protected is not None and protected(head) else None
        smallest = head.cost  # the least cost refused so far
        tries = 0
        for item in self._by_priority[head.priority].behind(head, BACKFILL_SCAN):
            if item.cost >= smallest or item.future.done():
                continue
            if guard is not None and item.tenant != head.tenant and not guard(item):
                continue
            tries += 1
            got = self._try(item, claim)
            if got is not None:
                return item, got
            if item.state is State.REJECTED:
                continue
            smallest = item.cost
            if tries >= BACKFILL_TRIES:
                break
        return None

    def expire(self) -> int:
        """Reject every item whose TTL has passed with queue_timeout; returns how many."""
        now = self._clock.monotonic()
        expired = 0
        while self._deadlines and self._deadlines[0][0] <= now:
            item = heapq.heappop(self._deadlines)[2]
            if item.state is State.QUEUED:
                self._remove(item)
                waited = now - item.enqueued_at
                self._reject(item, self._rejection(
                    QUEUE_TIMEOUT,
                    f"no endpoint of model {self.model!r} had room within {waited:.1f}s; the request was not sent",
                ))
                expired += 1
        return expired

    def reject_all(self, rejection: Rejection) -> int:
        """Empty the queue (model removed, shutdown): every waiter gets `rejection`."""
        rejected = 0
        while self._length:
            item = self._head()
            self._remove(item)
            self._reject(item, rejection)
            rejected += 1
        return rejected

    def _head(self) -> Item[T]:
        for band in self._bands:
            if band.length:
                item = band.head()
                assert item is not None
                return item
        raise LookupError("empty queue")

    def _remove(self, item: Item[T], *, dispatched: bool = False) -> None:
        self._by_priority[item.priority].remove(item, dispatched=dispatched)
        self._length -= 1
        left = self._tenants[item.tenant] - 1
        if left:
            self._tenants[item.tenant] = left
        else:
            del self._tenants[item.tenant]
        self._metrics.queued(self.model, item.tenant, item.klass, -1)

    def _rejection(self, code: str, message: str) -> RateLimited:
        seconds = self.config.retry_after_seconds
        return RateLimited(
            f"{message}; retry after {seconds}s", code=code, headers={"Retry-After": str(seconds)}
        )

    def _refuse(self, tenant: str, klass: str, message: str) -> RateLimited:
        self.counts.rejected += 1
        self._metrics.on_reject(self.model, tenant, klass, QUEUE_FULL)
        return self._rejection(QUEUE_FULL, message)

    def _reject(self, item: Item[T], rejection: Rejection) -> None:
        item.state = State.REJECTED
        item.reason = rejection.code
        item.future.set_exception(rejection)
        item.future.exception()  # marks it retrieved: no "never retrieved" log if the waiter is gone
        self.counts.rejected += 1
        self._metrics.on_reject(self.model, item.tenant, item.klass, rejection.code)
