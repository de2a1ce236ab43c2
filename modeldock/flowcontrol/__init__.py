"""Flow control: where requests wait, fairly, while every endpoint of their model is full."""

from modeldock.flowcontrol.capacity import (
    CounterReading,
    TokenRate,
    kv_capacity_tokens,
    read_counters,
    token_rate,
)
from modeldock.flowcontrol.config import QueueConfig
from modeldock.flowcontrol.cost import RequestCost, estimate_cost
from modeldock.flowcontrol.metrics import QueueMetrics
from modeldock.flowcontrol.queue import (
    QUEUE_FULL,
    QUEUE_TIMEOUT,
    Counts,
    FlowQueue,
    Item,
    State,
)
from modeldock.flowcontrol.queues import FlowQueues

__all__ = [
    "QUEUE_FULL", "QUEUE_TIMEOUT", "CounterReading", "Counts", "FlowQueue", "FlowQueues", "Item", "QueueConfig",
    "QueueMetrics", "RequestCost", "State", "TokenRate", "estimate_cost", "kv_capacity_tokens", "read_counters",
    "token_rate",
]
