from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
from picking_helpers import Page, Pool, endpoints, observe

from modeldock.clock import FakeClock
from modeldock.picking import Picker
from modeldock.types import Endpoint


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_picker(clock: FakeClock) -> Callable[..., Picker]:
    """Pickers on the fake clock with a seeded RNG, so runs repeat exactly."""

    def make(**kwargs: Any) -> Picker:
        kwargs.setdefault("rng", random.Random(7))
        return Picker(clock, **kwargs)

    return make


@pytest.fixture
def pool(make_picker: Callable[..., Picker], clock: FakeClock) -> Pool:
    """The prologue most picking tests share: a picker, its endpoints for "m", their first pages."""

    def make(n: int, *pages: Page, **kwargs: Any) -> tuple[Picker, list[Endpoint]]:
        picker = make_picker(**kwargs)
        eps = endpoints(n)
        picker.set_endpoints("m", eps)
        for ep, (waiting, running, kv) in zip(eps, pages, strict=False):
            observe(picker, clock, ep, waiting=waiting, running=running, kv=kv)
        return picker, eps

    return make
