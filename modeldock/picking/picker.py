"""Pick an endpoint and count it in flight in one step (no await in between)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from modeldock.clock import Clock
from modeldock.discovery.snapshot import Endpoint
from modeldock.errors import Unavailable


class Lease:
    """One request's claim on an endpoint; released exactly once."""

    def __init__(self, picker: Picker, endpoint: Endpoint) -> None:
        self._picker = picker
        self.endpoint = endpoint
        self.released = False

    def move_to(self, address: str) -> None:
        """Envoy reported that another endpoint served the request (after a retry)."""
        if self.released or address == self.endpoint.address:
            return
        try:
            target = Endpoint.parse(address)
        except ValueError:
            return
        self._picker._add(self.endpoint, -1)
        self.endpoint = target
        self._picker._add(target, +1)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._picker._add(self.endpoint, -1)


@dataclass(frozen=True)
class Pick:
    primary: Endpoint
    fallbacks: tuple[Endpoint, ...]
    lease: Lease

    @property
    def header_value(self) -> str:
        """The override_host list: primary first, then fallbacks."""
        return ",".join(e.address for e in (self.primary, *self.fallbacks))


class Picker:
    """Least in-flight picking over the endpoints the xDS snapshot holds."""

    def __init__(self, clock: Clock, fallbacks: int = 2) -> None:
        self._clock = clock
        self._fallbacks = fallbacks
        self._endpoints: dict[str, tuple[Endpoint, ...]] = {}
        self._in_flight: dict[Endpoint, int] = {}

    def set_endpoints(self, model: str, endpoints: Sequence[Endpoint]) -> None:
        self._endpoints[model] = tuple(endpoints)

    def endpoints(self, model: str) -> tuple[Endpoint, ...]:
        return self._endpoints.get(model, ())

    def pick(self, model: str) -> Pick:
        candidates = self._endpoints.get(model, ())
        if not candidates:
            raise Unavailable(f"No ready endpoints for model {model!r}.", code="no_ready_endpoints")
        ranked = sorted(candidates, key=lambda e: self._in_flight.get(e, 0))
        lease = Lease(self, ranked[0])
        self._add(ranked[0], +1)
        return Pick(ranked[0], tuple(ranked[1 : 1 + self._fallbacks]), lease)

    def in_flight(self, endpoint: Endpoint) -> int:
        return self._in_flight.get(endpoint, 0)

    def total_in_flight(self) -> int:
        return sum(self._in_flight.values())

    def _add(self, endpoint: Endpoint, delta: int) -> None:
        count = self._in_flight.get(endpoint, 0) + delta
        if count:
            self._in_flight[endpoint] = count
        else:
            self._in_flight.pop(endpoint, None)
