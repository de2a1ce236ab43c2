"""Helpers shared by the picking tests (a unique module name: tests are not packages)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from modeldock.clock import FakeClock
from modeldock.picking import Picker, Sample
from modeldock.types import Endpoint

MakePicker = Callable[..., Picker]  # the `make_picker` fixture: Picker(clock, **kwargs), seeded
Page = tuple[float, float, float]  # a page's (waiting, running, kv)


class Pool(Protocol):
    """The `pool` fixture: a seeded picker over `endpoints(n)` of model "m", the i-th endpoint observed
    at the i-th page when given (the rest have none); keyword arguments go to the picker."""

    def __call__(self, n: int, *pages: Page, **kwargs: object) -> tuple[Picker, list[Endpoint]]: ...


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint(f"10.0.{i // 250}.{i % 250 + 1}", 8000) for i in range(n)]


def observe(picker: Picker, clock: FakeClock, ep: Endpoint, waiting: float = 0.0, running: float = 0.0,
            kv: float = 0.0) -> None:
    picker.observe(ep, Sample(waiting=waiting, running=running, kv=kv), clock.monotonic())
