"""Which replica reads which endpoint's page: rendezvous hashing over the live replicas.

Every replica computes the same owner for an endpoint from the same set of names (its own and
the live peers' of its last exchange), with no coordination: the replica whose hash of
(name, address) is highest. A replica joining or leaving moves only the endpoints it wins or
held (about 1/N of them). While the views differ (a peer seen by one replica and not yet by
another), an endpoint may have two owners for an exchange or so, or none: the scraper's takeover
(`Scraper(scrapes=)`, wired in extproc/app.py) reads an endpoint whose relayed page is late.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def _weight(replica: str, address: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{replica}\0{address}".encode(), digest_size=8).digest(), "big")


class ScrapeSplit:
    """`owns(address)` for this replica, cached until the live set changes."""

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self._replicas: tuple[str, ...] = (replica,)
        self._owned: dict[str, bool] = {}

    @property
    def replicas(self) -> tuple[str, ...]:
        return self._replicas

    def set_peers(self, peers: Iterable[str]) -> None:
        """The live peers now (empty: this replica alone, so it owns every endpoint)."""
        replicas = tuple(sorted({self.replica, *peers}))
        if replicas != self._replicas:
            self._replicas = replicas
            self._owned.clear()

    def owner(self, address: str) -> str:
        return max(self._replicas, key=lambda name: (_weight(name, address), name))

    def owns(self, address: str) -> bool:
        owned = self._owned.get(address)
        if owned is None:
            owned = self._owned[address] = len(self._replicas) == 1 or self.owner(address) == self.replica
        return owned
