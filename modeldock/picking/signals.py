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


def correct(sample: Sample, delta: int) -> tuple[float, float]:
    """(waiting, running) adjusted by the net in-flight change since the sample.

    New requests are assumed to queue (conservative: a burst of picks between
    scrapes makes the endpoint look busier right away). Net completions come
    off the running batch first, then off the queue, never below zero.
    """
    if delta >= 0:
        return sample.waiting + delta, sample.running
    running = sample.running + delta
    if running >= 0:
        return sample.waiting, running
    return max(0.0, sample.waiting + running), 0.0


class Load:
    """Mutable per-endpoint ledger; only touched synchronously on the event loop."""

    __slots__ = ("base", "failures", "in_flight", "sample", "taken_at")

    def __init__(self) -> None:
        self.in_flight = 0
        self.sample: Sample | None = None
        self.taken_at = float("-inf")  # monotonic time of the sample
        self.base = 0  # in_flight when the sample was applied
        self.failures = 0  # consecutive scrape failures

    def signals(self, now: float, stale_after: float) -> Signals:
        sample = self.sample
        if sample is None or now - self.taken_at > stale_after:
            return Signals(self.in_flight, False, 0.0, 0.0, 0.0, sample)
        waiting, running = correct(sample, self.in_flight - self.base)
        return Signals(self.in_flight, True, waiting, running, sample.kv, sample)
