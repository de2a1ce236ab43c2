"""Flow control: where requests wait, fairly, while every endpoint of their model is full.

`dispatcher.Dispatcher.acquire(Waiting) -> Pick` is the one call the director makes; import it from
`modeldock.flowcontrol.dispatcher` (it sits above picking, which this package's other modules do not need).
"""

from modeldock.flowcontrol.config import QueueConfig
from modeldock.flowcontrol.cost import RequestCost, estimate_cost
from modeldock.flowcontrol.item import Item, State
from modeldock.flowcontrol.metrics import QueueMetrics
from modeldock.flowcontrol.queue import QUEUE_FULL, QUEUE_TIMEOUT, Counts, FlowQueue
from modeldock.flowcontrol.queues import FlowQueues
from modeldock.flowcontrol.waiting import Waiting

__all__ = [
    "QUEUE_FULL", "QUEUE_TIMEOUT", "Counts", "FlowQueue", "FlowQueues", "Item", "QueueConfig", "QueueMetrics",
    "RequestCost", "State", "Waiting", "estimate_cost",
]
