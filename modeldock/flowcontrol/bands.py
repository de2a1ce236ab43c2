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
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from modeldock.flowcontrol.queue import Item

T = TypeVar("T")


class Band(Generic[T]):
    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.flows: dict[str, deque[Item[T]]] = {}
        # Finish tag of each tenant's last dispatched item; tenants are config-bounded.
        self.finish: dict[str, float] = {}
        self.vtime = 0.0
        self.length = 0

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

    def head(self) -> Item[T] | None:
        """The item fair queueing dispatches next (O(tenants waiting in this band))."""
        best: Item[T] | None = None
        for flow in self.flows.values():
            item = flow[0]
            if best is None or (item.start, item.seq) < (best.start, best.seq):
                best = item
        return best

    def newest(self) -> Item[T] | None:
        """The most recently enqueued item: the first to shed when the queue is full."""
        best: Item[T] | None = None
        for flow in self.flows.values():
            item = flow[-1]
            if best is None or item.seq > best.seq:
                best = item
        return best

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
            flow.remove(item)  # never dispatched: only the head is
        if not flow:
            del self.flows[item.tenant]
        self.length -= 1
