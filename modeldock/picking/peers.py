"""What one replica holds on one endpoint, as its peers see it, and their sum as this replica counts it.

Every replica publishes its own holdings (`Holding`, from `Ledger.holdings`) and receives every live
peer's; `PeerLoad.merge` sums the peers' for one endpoint, on this replica's clock, and
`Ledger.set_peers` puts the sums beside the local counts: the `Signals` a scorer or the room rules read
count the whole pool's requests, while the ledger's own counts (`in_flight`, the leases, the metrics)
stay this replica's. The records are msgspec Structs, so the transport (modeldock/sharing) encodes and
validates them without a second definition.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

# A pick younger than this is published with its age: a peer's page read before the pick does not
# reflect it yet (a scrape round is 0.5 s, the exchange ~0.1 s). Older ones only count.
RECENT_SECONDS = 2.0


class Holding(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One replica's requests in flight on one endpoint."""

    address: str
    in_flight: int
    committed: int  # their committed tokens (prompt + output limit)
    # (seconds since picked, committed tokens, output limit or 0) of the picks younger than RECENT_SECONDS
    picks: tuple[tuple[float, int, int], ...] = ()
    # (engine steps left, committed tokens) of those that said their output limit (Signals.ends, relative)
    ends: tuple[tuple[float, int], ...] = ()
    # Seconds since the publisher's last page of the endpoint (its steps left are counted to then); -1: none.
    page_age: float = -1.0


class PeerLoad:
    """The peers' holdings on one endpoint, summed, on this replica's clock."""

    __slots__ = ("committed", "ends", "in_flight", "picks")

    def __init__(self) -> None:
        self.in_flight = 0
        self.committed = 0
        self.picks: list[tuple[float, int, int]] = []  # (picked at: this replica's monotonic time, tokens, output)
        # (steps left when received, tokens, when the publisher's page that counted them was read:
        # this replica's monotonic time, or -inf unknown)
        self.ends: list[tuple[float, int, float]] = []

    def add(self, holding: Holding, now: float, age: float) -> None:
        """`holding` was published `age` seconds before `now` (this replica's clock)."""
        self.in_flight += max(0, holding.in_flight)
        self.committed += max(0, holding.committed)
        for since, tokens, output in holding.picks:
            self.picks.append((now - age - max(0.0, since), max(0, tokens), max(0, output)))
        page_at = now - age - holding.page_age if holding.page_age >= 0 else float("-inf")
        self.ends.extend((max(0.0, left), max(0, tokens), page_at) for left, tokens in holding.ends)

    @staticmethod
    def merge(received: Iterable[tuple[float, Iterable[Holding]]], now: float) -> dict[str, PeerLoad]:
        """Address -> the peers' sum, from each peer's (age of its share, holdings)."""
        loads: dict[str, PeerLoad] = {}
        for age, holdings in received:
            for holding in holdings:
                load = loads.get(holding.address)
                if load is None:
                    load = loads[holding.address] = PeerLoad()
                load.add(holding, now, age)
        return loads
