"""Helpers shared by the picking tests (a unique module name: tests are not packages)."""

from __future__ import annotations

from modeldock.clock import FakeClock
from modeldock.picking import Picker, Sample
from modeldock.types import Endpoint


def endpoints(n: int) -> list[Endpoint]:
    return [Endpoint(f"10.0.{i // 250}.{i % 250 + 1}", 8000) for i in range(n)]


def observe(picker: Picker, clock: FakeClock, ep: Endpoint, waiting: float = 0.0, running: float = 0.0,
            kv: float = 0.0) -> None:
    picker.observe(ep, Sample(waiting=waiting, running=running, kv=kv), clock.monotonic())
