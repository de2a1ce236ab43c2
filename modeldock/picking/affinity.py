"""Prefix affinity as a request scorer: prefer endpoints that saw the prompt's beginning.

Its value for an endpoint is the miss fraction `1 - leading blocks it has seen /
the prompt's blocks` (prefix.py). It has no opinion (None) when no candidate has
seen the prompt's first block, so load alone decides then, exactly as without it.
It remembers every pick (`picked`), forgets endpoints that leave the snapshot
(`forget`), and nominates the endpoints that saw the first block as extra
contenders for power of two choices (`nominate`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from modeldock.picking.prefix import PrefixIndex
from modeldock.picking.scorers import PickRequest
from modeldock.picking.signals import Signals
from modeldock.types import Endpoint


class PrefixAffinity:
    name = "prefix"
    load = False

    def __init__(self, capacity: int = 200_000) -> None:
        self.index = PrefixIndex(capacity)

    def score(self, request: PickRequest, endpoints: Sequence[Endpoint],
              signals: Sequence[Signals]) -> Sequence[float] | None:
        blocks = request.prefix_blocks
        if not blocks:
            return None
        matched = self.index.matched(blocks, endpoints)
        if not matched:  # nobody has seen this prompt's beginning
            return None
        n = len(blocks)
        return [1.0 - matched.get(ep, 0) / n for ep in endpoints]

    def nominate(self, request: PickRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        if not request.prefix_blocks:
            return []
        return list(self.index.matched(request.prefix_blocks[:1], candidates))

    def picked(self, request: PickRequest, endpoint: Endpoint) -> None:
        if request.prefix_blocks:
            self.index.record(request.prefix_blocks, endpoint)

    def forget(self, endpoints: Iterable[Endpoint]) -> None:
        for ep in endpoints:
            self.index.forget(ep)
