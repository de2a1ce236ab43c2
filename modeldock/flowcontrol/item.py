"""A queued request as the queue holds it: `Item`, and the states it ends in."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass
from typing import Generic, TypeVar

from modeldock.flowcontrol.waiting import Waiting

T = TypeVar("T")


class State(enum.Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    REJECTED = "rejected"
    CANCELLED = "cancelled"


@dataclass(eq=False, slots=True)
class Item(Generic[T]):
    """One waiting request. The queue owns every field; callers read, never write.
    `tenant` .. `weight` repeat the request's for the bands' arithmetic (one attribute read)."""

    request: Waiting
    tenant: str
    klass: str
    priority: int
    cost: int
    weight: float
    enqueued_at: float
    deadline: float
    seq: int
    future: asyncio.Future[T]
    state: State = State.QUEUED
    reason: str | None = None  # the rejection code when state is REJECTED
    claim: T | None = None  # what dispatch's claim function returned
    taken: bool = False  # the waiter received the claim (or it was released)
    start: float = 0.0  # SFQ tags, set while the item is its flow's head
    finish: float = 0.0
    yielded_at: float | None = None  # first left room to an older peer head (pool_order.py)
