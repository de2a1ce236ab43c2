"""Pages one replica read, relayed to its peers, so N replicas do not read every page N times.

With sharing on (modeldock/sharing), each endpoint has one owner among the live replicas, the
only one that reads its page on the cadence (`Scraper(scrapes=)`). The owner's parsed samples
travel in its share as `PeerPage`s; every peer applies them to its own ledger as if it had read
the page itself, at the time the owner read it, on the peer's clock. What a page means to a
replica's correction (which of its own requests the page shows) is the peer's own business:
the requests it had picked before the page was read (`Ledger.in_flight_before`).

`PageRelay` holds this replica's latest own read of each endpoint, as the record it publishes
(built once per read, not once per exchange), and the last relayed page it applied from each
endpoint (so a share that repeats a page changes nothing).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from modeldock.picking.signals import Sample
from modeldock.types import Endpoint

# A page older than this is not published (a peer would hold a sample the owner itself no longer
# trusts; the owner's cadence reads every endpoint far more often than this).
MAX_PAGE_AGE_SECONDS = 5.0


class PeerPage(msgspec.Struct, frozen=True, array_like=True):
    """One endpoint's page as its reader parsed it. Counters and the capacity are -1 when unknown.
    Array-like for size; trailing fields a newer version adds are ignored (a rolling upgrade)."""

    address: str
    seq: int  # the reader's read number, counting up: a page it publishes again has the same one
    age: float  # seconds between the read and the share's writing
    waiting: float
    running: float
    kv: float
    tokens_total: float = -1.0
    generated_total: float = -1.0
    capacity: float = -1.0  # the reader's known KV capacity (tokens), sent with every page
    block_size: int = 0
    rates: bool = True  # read in a round (not out of turn): rates may be learned from it

    def sample(self) -> Sample:
        return Sample(
            waiting=max(0.0, self.waiting),
            running=max(0.0, self.running),
            kv=min(1.0, max(0.0, self.kv)),
            capacity=self.capacity if self.capacity > 0 else None,
            tokens_total=self.tokens_total if self.tokens_total >= 0 else None,
            generated_total=self.generated_total if self.generated_total >= 0 else None,
            block_size=self.block_size if self.capacity > 0 and self.block_size > 0 else None,
        )


class _Own:
    __slots__ = ("page", "taken_at")

    def __init__(self, page: PeerPage, taken_at: float) -> None:
        self.page = page
        self.taken_at = taken_at


class PageRelay:
    def __init__(self) -> None:
        self._seq = 0
        self._own: dict[Endpoint, _Own] = {}
        self._applied: dict[Endpoint, tuple[str, int]] = {}  # endpoint -> (reader, seq) last applied

    def record(self, endpoint: Endpoint, sample: Sample, taken_at: float, capacity: float, block: int,
               rates: bool) -> None:
        """This replica read `endpoint`'s page (taken at `taken_at`, its clock)."""
        self._seq += 1
        self._own.pop(endpoint, None)  # kept in the order read: the newest last
        self._own[endpoint] = _Own(PeerPage(
            endpoint.address, self._seq, 0.0, sample.waiting, sample.running, sample.kv,
            -1.0 if sample.tokens_total is None else sample.tokens_total,
            -1.0 if sample.generated_total is None else sample.generated_total,
            capacity if capacity > 0 else -1.0, block, rates,
        ), taken_at)

    def pages(self, now: float, window: float = MAX_PAGE_AGE_SECONDS) -> tuple[PeerPage, ...]:
        """This replica's own reads of the last `window` seconds (the latest of each endpoint),
        aged to `now`, for its share. A share carries a page for a few exchanges, not forever: a
        peer reading every share sees each page more than once, and the share stays the size of
        the reads of a window, not of the pool."""
        out = []
        window = min(window, MAX_PAGE_AGE_SECONDS)
        for own in reversed(self._own.values()):
            age = now - own.taken_at
            if age > window:
                break  # the rest were read earlier still
            out.append(msgspec.structs.replace(own.page, age=max(0.0, age)))
        return tuple(out)

    def forget(self, keep: Iterable[Endpoint]) -> None:
        """Drop what is held for endpoints not in `keep` (they left the snapshot)."""
        kept = set(keep)
        for table in (self._own, self._applied):
            for ep in [ep for ep in table if ep not in kept]:
                del table[ep]

    def fresh(self, endpoint: Endpoint, reader: str, seq: int) -> bool:
        """Whether `reader`'s page `seq` of `endpoint` is new here (and mark it applied)."""
        key = (reader, seq)
        if self._applied.get(endpoint) == key:
            return False
        self._applied[endpoint] = key
        return True
