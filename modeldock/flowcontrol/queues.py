"""One FlowQueue per model, made on first use.

A model's requests only compete for that model's endpoints, so each model gets
its own queue: a saturated model never holds back another model's requests
(no head-of-line blocking across models), and bounds apply per model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from modeldock.clock import Clock
from modeldock.errors import Rejection
from modeldock.flowcontrol.config import QueueConfig
from modeldock.flowcontrol.metrics import QueueMetrics
from modeldock.flowcontrol.queue import FlowQueue

T = TypeVar("T")


class FlowQueues(Generic[T]):
    def __init__(
        self,
        config: QueueConfig,
        clock: Clock,
        *,
        release: Callable[[T], None],
        metrics: QueueMetrics | None = None,
        drain_rate: Callable[[str], float] | None = None,
    ) -> None:
        """`drain_rate(model)`: tokens/second the model's endpoints process together, for each queue's
        drain budget (FlowQueue)."""
        self.config = config
        self._drain_rate = drain_rate
        self._clock = clock
        self._release = release
        self._metrics = metrics or QueueMetrics(None)
        self._queues: dict[str, FlowQueue[T]] = {}

    def get(self, model: str) -> FlowQueue[T]:
        queue = self._queues.get(model)
        if queue is None:
            rate = self._drain_rate
            queue = self._queues[model] = FlowQueue(
                model, self.config, self._clock, release=self._release, metrics=self._metrics,
                drain_rate=None if rate is None else lambda: rate(model),
            )
        return queue

    def waiting(self, model: str) -> FlowQueue[T] | None:
        """The model's queue if requests wait in it, else None (a dict lookup: the hot path's check)."""
        queue = self._queues.get(model)
        return queue if queue is not None and len(queue) else None

    def __iter__(self) -> Iterator[FlowQueue[T]]:
        return iter(list(self._queues.values()))

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def expire(self) -> int:
        return sum(queue.expire() for queue in self._queues.values())

    def discard(self, model: str, rejection: Rejection) -> int:
        """The model went away: its waiters get `rejection` and its queue is dropped."""
        queue = self._queues.pop(model, None)
        return queue.reject_all(rejection) if queue is not None else 0
