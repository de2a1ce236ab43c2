"""Flow control: where requests wait, fairly, while every endpoint of their model is full.

`dispatcher.Dispatcher.acquire(Waiting) -> Pick` is the one call the director makes; import it from
`modeldock.flowcontrol.dispatcher` (it sits above picking, which this package's other modules do not need).
The names below are loaded on first use (PEP 562), so importing `modeldock.flowcontrol.config` (the
`queue:` section the ground-floor schema mounts) loads nothing else of flow control, nor Prometheus.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modeldock.flowcontrol.config import QueueConfig
    from modeldock.flowcontrol.cost import RequestCost, estimate_cost
    from modeldock.flowcontrol.item import Item, State
    from modeldock.flowcontrol.metrics import QueueMetrics
    from modeldock.flowcontrol.queue import QUEUE_FULL, QUEUE_TIMEOUT, Counts, FlowQueue
    from modeldock.flowcontrol.queues import FlowQueues
    from modeldock.flowcontrol.waiting import Waiting

_HOMES = {
    "QueueConfig": "config", "RequestCost": "cost", "estimate_cost": "cost", "Item": "item", "State": "item",
    "QueueMetrics": "metrics", "QUEUE_FULL": "queue", "QUEUE_TIMEOUT": "queue", "Counts": "queue",
    "FlowQueue": "queue", "FlowQueues": "queues", "Waiting": "waiting",
}

__all__ = [
    "QUEUE_FULL", "QUEUE_TIMEOUT", "Counts", "FlowQueue", "FlowQueues", "Item", "QueueConfig", "QueueMetrics",
    "RequestCost", "State", "Waiting", "estimate_cost",
]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once: later lookups do not come here
    return value
