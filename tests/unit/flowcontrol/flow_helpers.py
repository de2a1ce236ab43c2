"""Helpers shared by the flow-control tests: a queue on a FakeClock with numbered claims."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from modeldock.clock import FakeClock
from modeldock.flowcontrol import FlowQueue, QueueConfig, Waiting


class Harness:
    """A FlowQueue[int] whose claims are numbered; released claims are recorded."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None, *, drain_rate: Callable[[], float] | None = None,
                 shed_after: float = 0.0, **config: Any) -> None:
        self.clock = FakeClock()
        self.released: list[int] = []
        self.config = QueueConfig(**config)
        self.queue: FlowQueue[int] = FlowQueue("m", self.config, self.clock, release=self.released.append, loop=loop,
                                               drain_rate=drain_rate, shed_after=shed_after)
        self.next_claim = 0

    def claim_all(self, budget: float = float("inf")) -> list[tuple[str, int, str]]:
        """Dispatch while `budget` tokens last; returns (tenant, cost, class) in dispatch order."""
        order: list[tuple[str, int, str]] = []
        left = [budget]

        def claim(item: Any) -> int | None:
            if item.cost > left[0]:
                return None
            left[0] -= item.cost
            order.append((item.tenant, item.cost, item.klass))
            self.next_claim += 1
            return self.next_claim

        self.queue.dispatch(claim)
        return order


def waiting(tenant: str, cost: int, *, klass: str | None = None, weight: float = 1.0, model: str = "m") -> Waiting:
    """A request for the queue, as the dispatcher hands it one."""
    return Waiting(model=model, tenant=tenant, cost=cost, klass=klass or "", weight=weight)
