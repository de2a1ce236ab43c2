"""Prefix affinity as a request scorer: prefer endpoints that saw the prompt's beginning.

Its value for an endpoint is the miss fraction `1 - leading blocks it has seen /
the prompt's blocks` (prefix.py). When no candidate has seen the prompt's first
block in this replica's table, the prefix's **home** (prefix.home: rendezvous
hashing of the first block's stable hash with each candidate's address) scores
0 and every other candidate 1, the miss of an endpoint that holds nothing: so
every replica's first send of a prefix goes to the same endpoint while load
allows, and the tables they then learn alone agree. The others all score 1, so
among them load alone decides, as without affinity (a rank per endpoint would
tilt every cold prompt's choice between them by up to the prefix weight).
It remembers every pick (`picked`), forgets endpoints that leave the snapshot
(`forget`), and nominates the endpoints that saw the first block, or else the
home, as extra contenders for power of two choices (`nominate`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from modeldock.picking.prefix import PrefixIndex, home
from modeldock.picking.scorers import PickRequest
from modeldock.picking.signals import Signals
from modeldock.types import Endpoint


class PrefixAffinity:
    name = "prefix"
    load = False

    def __init__(self, capacity: int = 200_000, *, homing: bool = True) -> None:
        self.index = PrefixIndex(capacity)
        # False: the rule before homes (no opinion without a record), for benchmarks/affinity_replicas.py.
        self.homing = homing
        self._keys: dict[Endpoint, int] = {}  # endpoint -> its rendezvous key (prefix.endpoint_key)

    def home(self, blocks: Sequence[int], candidates: Sequence[Endpoint]) -> Endpoint | None:
        """Where every replica sends this prompt's prefix when nobody has a record of it."""
        return home(blocks[0], candidates, self._keys) if blocks else None

    def score(self, request: PickRequest, endpoints: Sequence[Endpoint],
              signals: Sequence[Signals]) -> Sequence[float] | None:
        blocks = request.prefix_blocks
        if not blocks:
            return None
        matched = self.index.matched(blocks, endpoints)
        if not matched:  # nobody here has seen this prompt's beginning: its home, alike in every replica
            if not self.homing:
                return None
            best = home(blocks[0], endpoints, self._keys)
            return [0.0 if ep == best else 1.0 for ep in endpoints]
        n = len(blocks)
        return [1.0 - matched.get(ep, 0) / n for ep in endpoints]

    def nominate(self, request: PickRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        blocks = request.prefix_blocks
        if not blocks:
            return []
        seen = list(self.index.matched(blocks[:1], candidates))
        if seen or not self.homing:
            return seen
        best = home(blocks[0], candidates, self._keys)
        return [best] if best is not None else []

    def picked(self, request: PickRequest, endpoint: Endpoint) -> None:
        if request.prefix_blocks:
            self.index.record(request.prefix_blocks, endpoint)

    def forget(self, endpoints: Iterable[Endpoint]) -> None:
        for ep in endpoints:
            self.index.forget(ep)
            self._keys.pop(ep, None)
