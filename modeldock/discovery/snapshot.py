"""Immutable endpoint snapshots and the store that swaps them atomically.

A discovery source (static file or Kubernetes) calls `SnapshotStore.update`
and `SnapshotStore.confirm` on the event-loop thread. Readers take
`store.current` (one immutable object) and never see a half-applied change.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from modeldock.clock import Clock


@dataclass(frozen=True, order=True)
class Endpoint:
    host: str  # an IPv4 or IPv6 literal, never a name
    port: int

    @property
    def address(self) -> str:
        """`ip:port`, with brackets around IPv6, as Envoy's override_host wants it."""
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """Parse `ip:port` or `[v6]:port`; raises ValueError with the reason."""
        text = text.strip()
        if text.startswith("["):
            host, sep, port = text[1:].partition("]:")
            if not sep:
                raise ValueError(f"{text!r} is not [ipv6]:port")
        else:
            host, sep, port = text.rpartition(":")
            if not sep:
                raise ValueError(f"{text!r} is not ip:port")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"{host!r} in {text!r} is not an IP address") from None
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"port {port!r} in {text!r} is not 1-65535")
        return cls(ip.compressed, int(port))


@dataclass(frozen=True)
class ModelEndpoints:
    endpoints: tuple[Endpoint, ...]
    confirmed_at: float  # monotonic time the source last vouched for this list


@dataclass(frozen=True)
class Snapshot:
    models: Mapping[str, ModelEndpoints] = field(default_factory=lambda: MappingProxyType({}))

    def endpoints(self, model: str) -> tuple[Endpoint, ...]:
        entry = self.models.get(model)
        return entry.endpoints if entry else ()

    def age(self, model: str, now: float) -> float:
        entry = self.models.get(model)
        return float("inf") if entry is None else max(0.0, now - entry.confirmed_at)


class SnapshotStore:
    """Owns the current snapshot; every change is a new immutable object."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._current = Snapshot()
        self._listeners: list[Callable[[Snapshot], None]] = []
        self.changed = asyncio.Event()  # set on every swap; readers clear it

    @property
    def current(self) -> Snapshot:
        return self._current

    def subscribe(self, listener: Callable[[Snapshot], None]) -> None:
        self._listeners.append(listener)

    def update(self, model: str, endpoints: Iterable[Endpoint]) -> None:
        """Replace a model's endpoints (sorted, de-duplicated) and confirm it."""
        entry = ModelEndpoints(tuple(sorted(set(endpoints))), self._clock.monotonic())
        self._swap(model, entry)

    def confirm(self, model: str) -> None:
        """The source vouched that the model's list is still current."""
        old = self._current.models.get(model)
        endpoints = old.endpoints if old else ()
        self._swap(model, ModelEndpoints(endpoints, self._clock.monotonic()))

    def _swap(self, model: str, entry: ModelEndpoints) -> None:
        models = dict(self._current.models)
        models[model] = entry
        self._current = Snapshot(MappingProxyType(models))
        self.changed.set()
        for listener in self._listeners:
            listener(self._current)
