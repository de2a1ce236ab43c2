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

from modeldock.picking.prefix import PrefixIndex, home_index, multipliers
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
        self._keys: dict[Endpoint, int] = {}  # endpoint -> its rendezvous multiplier (prefix.multipliers)
        # The last candidate tuple's multipliers: the ledger hands out one tuple per model until the
        # snapshot changes, and an Endpoint's hash runs in Python (a dataclass), so this saves n lookups.
        self._last: tuple[Sequence[Endpoint], list[int]] = ((), [])

    def home(self, blocks: Sequence[int], candidates: Sequence[Endpoint]) -> Endpoint | None:
        """Where every replica sends this prompt's prefix when nobody has a record of it."""
        i = home_index(blocks[0], self._multipliers(candidates)) if blocks else -1
        return candidates[i] if i >= 0 else None

    def _multipliers(self, candidates: Sequence[Endpoint]) -> list[int]:
        last, mults = self._last
        if candidates is last:
            return mults
        mults = multipliers(candidates, self._keys)
        if isinstance(candidates, tuple):  # immutable: safe to reuse while it is the one passed
            self._last = (candidates, mults)
        return mults

    def score(self, request: PickRequest, endpoints: Sequence[Endpoint],
              signals: Sequence[Signals]) -> Sequence[float] | None:
        blocks = request.prefix_blocks
        if not blocks:
            return None
        matched = self.index.matched(blocks, endpoints)
        if not matched:  # nobody here has seen this prompt's beginning: its home, alike in every replica
            if not self.homing or not endpoints:
                return None
            values = [1.0] * len(endpoints)
            values[home_index(blocks[0], self._multipliers(endpoints))] = 0.0
            return values
        n = len(blocks)
        return [1.0 - matched.get(ep, 0) / n for ep in endpoints]

    def nominate(self, request: PickRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]:
        blocks = request.prefix_blocks
        if not blocks:
            return []
        seen = list(self.index.matched(blocks[:1], candidates))
        if seen or not self.homing:
            return seen
        best = self.home(blocks, candidates)
        return [best] if best is not None else []

    def picked(self, request: PickRequest, endpoint: Endpoint) -> None:
        if request.prefix_blocks:
            self.index.record(request.prefix_blocks, endpoint)

    def forget(self, endpoints: Iterable[Endpoint]) -> None:
        for ep in endpoints:
            self.index.forget(ep)
            self._keys.pop(ep, None)
        self._last = ((), [])
