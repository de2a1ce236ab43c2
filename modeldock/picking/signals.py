"""What picking knows about one endpoint: the last scraped sample and local counts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class Sample:
    """One scrape of a vLLM server, summed over its engines."""

    waiting: float  # requests queued (vllm:num_requests_waiting)
    running: float  # sequences in the running batch (vllm:num_requests_running)
    kv: float  # KV-cache usage as a 0..1 fraction


class Signals(NamedTuple):
    """One endpoint as a scorer sees it at pick time."""

    in_flight: int  # requests this gateway has on it now
    fresh: bool  # True when the sample is younger than stale_after
    waiting: float  # corrected estimate; 0 when not fresh
    running: float  # corrected estimate; 0 when not fresh
    kv: float  # from the sample, not corrected; 0 when not fresh
    sample: Sample | None  # the raw latest sample, whatever its age


def correct(sample: Sample, new: int, gone: int = 0) -> tuple[float, float]:
    """(waiting, running) estimated from the sample and what happened since.

    `new`: requests picked since the sample and still in flight. They are
    assumed queued (conservative: they may still be prefilling, and a burst of
    picks between scrapes makes the endpoint look busier right away).
    `gone`: requests that were in flight at the sample and have finished since;
    they come off the running batch first, then off the sample's queue, never
    below zero (they never cancel `new`: picks and completions are counted
    apart, so a sample whose requests all turned over still shows the new ones).
    A negative `new` is read as completions (the older net-delta form).
    """
    if new < 0:
        new, gone = 0, gone - new
    waiting = sample.waiting
    running = sample.running - gone
    if running < 0:
        waiting = max(0.0, waiting + running)
        running = 0.0
    return waiting + new, running


class Load:
    """Mutable per-endpoint ledger; only touched synchronously on the event loop.

    Every lease carries a pick sequence number (`Picker` counts picks). `mark`
    is the last sequence number the current sample already reflects: a lease
    above it was picked since the sample (`new` while in flight), one at or
    below it was in the sample (`gone` once it finishes).
    """

    __slots__ = ("failures", "gone", "last_pick", "leases", "mark", "new", "sample", "taken_at")

    def __init__(self) -> None:
        self.leases: set[int] = set()  # sequence numbers of the requests in flight here
        self.sample: Sample | None = None
        self.taken_at = float("-inf")  # monotonic time of the sample
        self.mark = 0  # last pick sequence number the sample reflects
        self.new = 0  # in flight and picked after `mark`
        self.gone = 0  # in flight at the sample, finished since
        self.last_pick = 0  # sequence number of the latest pick here (0: never)
        self.failures = 0  # consecutive scrape failures

    @property
    def in_flight(self) -> int:
        return len(self.leases)

    def add(self, seq: int) -> None:
        self.leases.add(seq)
        self.new += 1  # seq is the newest number: always above the mark
        self.last_pick = seq

    def remove(self, seq: int) -> None:
        self.leases.discard(seq)
        if seq > self.mark:
            self.new -= 1
        else:
            self.gone += 1

    def rebase(self, mark: int, in_flight_at: int | None) -> None:
        """A new sample reflecting the picks up to `mark`; `in_flight_at` requests
        were in flight when it was taken (None: as many as now)."""
        if in_flight_at is None:
            self.mark, self.new, self.gone = mark, 0, 0
            return
        # Picks since the page arrived: the newest leases above the count then.
        extra = len(self.leases) - in_flight_at
        if extra > 0:
            ordered = sorted(self.leases)
            self.mark = ordered[-extra] - 1
            self.new, self.gone = extra, 0
        else:
            self.mark, self.new, self.gone = mark, 0, -extra

    def signals(self, now: float, stale_after: float) -> Signals:
        sample = self.sample
        in_flight = len(self.leases)
        if sample is None or now - self.taken_at > stale_after:
            return Signals(in_flight, False, 0.0, 0.0, 0.0, sample)
        waiting, running = correct(sample, self.new, self.gone)
        return Signals(in_flight, True, waiting, running, sample.kv, sample)
