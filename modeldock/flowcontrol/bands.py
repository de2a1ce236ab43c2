"""One priority band: start-time fair queueing (SFQ) over tenants, FIFO within a tenant.

Each tenant's queue (a flow) is FIFO. Only a flow's head carries tags: when an
item becomes its flow's head it gets

    start  = max(V, finish of the tenant's last dispatched item)
    finish = start + cost_tokens / weight

and the band dispatches the head with the smallest start tag; V (virtual time)
becomes that start tag. A tenant's share therefore follows tokens, not requests:
one 4000-token request moves its flow's tags as far as four 1000-token ones.
Tagging heads, not whole flows, means an item that leaves without being
dispatched (cancelled, timed out, evicted) charges nothing to the items behind it.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from modeldock.flowcontrol.item import Item

T = TypeVar("T")


class Band(Generic[T]):
    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.flows: dict[str, deque[Item[T]]] = {}
        # Finish tag of each tenant's last dispatched item; tenants are config-bounded.
        self.finish: dict[str, float] = {}
        self.vtime = 0.0
        self.length = 0
        self.tokens = 0  # cost of every item waiting in the band
        self.queued: dict[str, int] = {}  # tenant -> cost of its waiting items

    def _tag(self, item: Item[T]) -> None:
        item.start = max(self.vtime, self.finish.get(item.tenant, 0.0))
        item.finish = item.start + item.cost / item.weight

    def add(self, item: Item[T]) -> None:
        flow = self.flows.get(item.tenant)
        if flow is None:
            flow = self.flows[item.tenant] = deque()
        flow.append(item)
        if len(flow) == 1:
            self._tag(item)
        self.length += 1
        self.tokens += item.cost
        self.queued[item.tenant] = self.queued.get(item.tenant, 0) + item.cost

    def head(self) -> Item[T] | None:
        """The item fair queueing dispatches next (O(tenants waiting in this band))."""
        best: Item[T] | None = None
        for flow in self.flows.values():
            item = flow[0]
            if best is None or (item.start, item.seq) < (best.start, best.seq):
                best = item
        return best

    def heads(self) -> list[Item[T]]:
        """Every flow's head, in the order fair queueing would dispatch them."""
        return sorted((flow[0] for flow in self.flows.values()), key=lambda item: (item.start, item.seq))

    def behind(self, head: Item[T], count: int) -> list[Item[T]]:
        """Up to `count` items after `head`: the flows in fair order of their heads, each in FIFO
        order (what backfill may try when `head` does not fit)."""
        out: list[Item[T]] = []
        for first in self.heads():
            for item in self.flows[first.tenant]:
                if item is not head:
                    out.append(item)
                    if len(out) >= count:
                        return out
        return out

    def heaviest(self) -> tuple[str, float]:
        """The tenant holding the most of the band, in tokens queued / its weight, and that
        amount (the band must not be empty); ties go to the tenant with the newest item, so
        equal tenants shed newest first. O(tenants waiting in this band).

        The heaviest tenant is always at or over its weighted share of the band (the largest
        tokens / weight is at least their weighted mean, sum(tokens) / sum(weights)), and over
        it whenever any tenant is: shedding its newest item never evicts a tenant within its
        share while another is over it."""
        tenant, flow = max(self.flows.items(), key=lambda kv: (self.queued[kv[0]] / kv[1][0].weight, kv[1][-1].seq))
        return tenant, self.queued[tenant] / flow[0].weight

    def remove(self, item: Item[T], *, dispatched: bool) -> None:
        flow = self.flows[item.tenant]
        if flow[0] is item:
            flow.popleft()
            if dispatched:
                self.vtime = max(self.vtime, item.start)
                self.finish[item.tenant] = item.finish
            if flow:
                self._tag(flow[0])
        else:
            flow.remove(item)
            if dispatched:  # passed the head (backfill): the tenant's next turn moves back by its cost
                head = flow[0]
                head.start += item.cost / item.weight
                head.finish += item.cost / item.weight
        if not flow:
            del self.flows[item.tenant]
            del self.queued[item.tenant]
        else:
            self.queued[item.tenant] -= item.cost
        self.length -= 1
        self.tokens -= item.cost

    def ahead(self, tenant: str, weight: float) -> float:
        """Tokens that fair queueing would dispatch before a new item of `tenant` (weight
        `weight`) enqueued now. Its start tag would be the later of V and the end of its flow
        (a backlogged flow's items follow one another by cost / weight); every other flow is
        ahead by (that tag - its head's start tag) x its weight in tokens, at most what it
        holds. O(tenants waiting in the band)."""
        own = self.flows.get(tenant)
        if own:
            start = own[0].start + self.queued[tenant] / weight
        else:
            start = max(self.vtime, self.finish.get(tenant, 0.0))
        total = float(self.queued.get(tenant, 0))
        for name, flow in self.flows.items():
            if name == tenant:
                continue
            head = flow[0]
            if start > head.start:
                total += min(float(self.queued[name]), (start - head.start) * head.weight)
        return total
