from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from modeldock.clock import FakeClock
from modeldock.picking import Picker


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
