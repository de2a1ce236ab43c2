"""`Waiting`: one request asking flow control for an endpoint of its model (`Dispatcher.acquire`).

Everything the queue orders it by (tenant, weight, class, cost) and everything the picker needs to
pick and count it when its turn comes (prefix blocks, output tokens, a subset hint), by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from modeldock.types import Endpoint


@dataclass(frozen=True, slots=True, kw_only=True)
class Waiting:
    model: str
    tenant: str
    cost: int  # tokens: the prompt estimate + the output it may generate (RequestCost.total)
    weight: float = 1.0  # the tenant's fair-queueing weight (> 0)
    klass: str = ""  # the queue class; "" for the queue's default
    output: int | None = None  # the part of `cost` that is output (the picker's tokens rule)
    prefix: Sequence[int] = ()  # the prompt's block hashes (prefix affinity)
    subset: frozenset[Endpoint] | None = None  # only these endpoints may serve it (picker mode's hint)
    request_id: str = ""  # for the logs
