"""A Picker seen through the Scraper's sink protocol, recording every page it is given.

    sink = RecordingSink(picker)
    scraper = Scraper(sink, clock, ...)
    ...
    await sink.out_of_turn.wait()       # a read out of turn (`Scraper.refresh`) was applied
    assert sink.reads[ep] == 3          # pages applied for `ep`, of the rounds and out of turn
    await sink.until(lambda: sink.reads[ep] >= 4)   # fails after 5 s
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from modeldock.picking import Picker, Sample
from modeldock.types import Endpoint


class RecordingSink:
    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.reads: Counter[Endpoint] = Counter()
        self.failures: Counter[Endpoint] = Counter()
        self.refreshed: list[Endpoint] = []  # endpoints read out of turn, in order
        self.out_of_turn = asyncio.Event()  # set at each page read out of turn; the test clears it
        self._applied = asyncio.Event()

    def scrape_targets(self) -> Mapping[Endpoint, str | None]:
        return self.picker.scrape_targets()

    def observe(self, endpoint: Endpoint, sample: Sample, taken_at: float, in_flight_at: int | None = None,
                out_of_turn: bool = False) -> None:
        self.reads[endpoint] += 1
        self._applied.set()
        if out_of_turn:
            self.refreshed.append(endpoint)
            self.out_of_turn.set()
        self.picker.observe(endpoint, sample, taken_at, in_flight_at, out_of_turn)

    def observe_failure(self, endpoint: Endpoint) -> None:
        self.failures[endpoint] += 1
        self._applied.set()
        self.picker.observe_failure(endpoint)

    def in_flight(self, endpoint: Endpoint) -> int:
        return self.picker.in_flight(endpoint)

    def endpoints(self, model: str) -> Sequence[Endpoint]:
        return self.picker.endpoints(model)

    async def until(self, condition: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait until `condition()` holds, checked after each page or failure applied; fails after `timeout`."""
        async with asyncio.timeout(timeout):
            while not condition():
                self._applied.clear()
                await self._applied.wait()
