"""Immutable endpoint snapshots and the store that swaps them atomically.

A discovery source (static file or Kubernetes) calls `SnapshotStore.update`
and `SnapshotStore.confirm` on the event-loop thread, or `update_many` and
`confirm_many` for a batch: one new snapshot and one notification per call,
so a batch of 1,000 models is one swap and one xDS rebuild. Readers take
`store.current` (one immutable object) and never see a half-applied change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from modeldock.clock import Clock
from modeldock.types import Endpoint


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

    @property
    def current(self) -> Snapshot:
        return self._current

    def subscribe(self, listener: Callable[[Snapshot], None]) -> None:
        self._listeners.append(listener)

    def update(self, model: str, endpoints: Iterable[Endpoint]) -> None:
        """Replace a model's endpoints (sorted, de-duplicated) and confirm it."""
        self.update_many({model: endpoints})

    def confirm(self, model: str) -> None:
        """The source vouched that the model's list is still current."""
        self.confirm_many((model,))

    def confirm_many(self, models: Iterable[str]) -> None:
        """Confirm several models: one swap, one notification."""
        self.update_many({}, models)

    def update_many(self, changes: Mapping[str, Iterable[Endpoint]], confirmed: Iterable[str] = ()) -> None:
        """Replace the endpoints of `changes` and confirm them and `confirmed`, as one new snapshot.

        Listeners hear of it once, however many models it touches; nothing at all is nothing.
        """
        now = self._clock.monotonic()
        models = dict(self._current.models)
        touched = False
        for model in confirmed:
            if model not in changes:
                old = models.get(model)
                models[model] = ModelEndpoints(old.endpoints if old else (), now)
                touched = True
        for model, endpoints in changes.items():
            models[model] = ModelEndpoints(tuple(sorted(set(endpoints))), now)
            touched = True
        if not touched:
            return
        self._current = Snapshot(MappingProxyType(models))
        for listener in self._listeners:
            listener(self._current)
