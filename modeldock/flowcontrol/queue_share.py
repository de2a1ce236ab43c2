"""What one replica's queue holds, for its peers: tokens waiting per (model, class, tenant).

The drain budget (queue.py) asks whether the tokens that would be dispatched before a new request
drain within `queue.max_wait_seconds`. With several replicas the pool drains every replica's queue,
so the tokens ahead include the peers' (`peer_ahead`): all of every higher class, the same tenant's
in full, and other tenants' as fair queueing would interleave them. Which replica holds a request is
local; whether the pool has room to wait for it is global.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec


class QueuedFlow(msgspec.Struct, frozen=True, array_like=True):
    """One tenant's requests waiting in one class of one model's queue on one replica."""

    model: str
    priority: int
    tenant: str
    weight: float
    tokens: int
    # How long its head had waited when the share was built (the transport ages it on to when it
    # applies the share): which replica's head one queue would serve first (pool_order.py).
    waited: float = 0.0
    head: int = 0  # its head's cost in tokens (0: not said)


def peer_ahead(flows: Iterable[QueuedFlow], tenant: str, priority: int, weight: float, own: float) -> float:
    """Peers' tokens that would be dispatched before a new request of `tenant` (at `weight`, with
    `own` of its tokens queued here already): every higher class's, its own tenant's, and of each
    other tenant in its class what weighted fair queueing serves meanwhile (`own` / weight of
    virtual time, times the other's weight, at most what it holds)."""
    total = 0.0
    vtime = own / weight if weight > 0 else 0.0
    for flow in flows:
        if flow.priority > priority or flow.tenant == tenant:
            total += flow.tokens
        elif flow.priority == priority:
            total += min(float(flow.tokens), vtime * flow.weight)
    return total
