"""The exact boundary of `fits_as_they_finish`: a sequence of ours still holds its KV at the last step
it may run and frees it only after. Two of ours are done by step 2 and step 3; a new request (3 tokens
of output) meets the second one at its step 2, where the second still runs: that step binds. A request
that fills the cache exactly there fits; one token more does not. Freeing the second a step early skips
that step and admits the larger one past capacity."""

from __future__ import annotations

import pytest

from modeldock.picking.saturation import Saturation, fits_as_they_finish, held_tokens
from modeldock.picking.signals import Signals

ROOM = Saturation(room=True, kv_full=1.0)
CAPACITY = 1024.0  # a power of two: kv * CAPACITY is exact
HELD = 400  # the KV the two sequences hold now, together
OUTPUT = 3

# By hand, the new request holding prompt + k at its step k, the others min(committed left, 400 + k
# each still running):
#   k = 1 (the first's last step):  min(800, 400 + 2) + prompt + 1 = prompt + 403
#   k = 2 (the second's last step): min(500, 400 + 2) + prompt + 2 = prompt + 404   <- binds
#   k = 3 (its own last step, both gone):           0 + prompt + 3
FITS_EXACTLY = 1024 - 404 + OUTPUT  # cost (prompt + output) that fills the cache at k = 2


def two_of_ours(steps: float = 0.0, first: float = 2.0, second: float = 3.0) -> Signals:
    return Signals(in_flight=2, fresh=True, waiting=0.0, running=2.0, kv=HELD / CAPACITY, sample=None,
                   committed=300 + 500, capacity=CAPACITY, speed=400.0,
                   ends=((steps + first, 300), (steps + second, 500)), steps=steps)


@pytest.mark.parametrize("steps", [0.0, 1000.0])
def test_a_request_that_fills_the_cache_at_the_binding_step_fits_and_one_token_more_does_not(steps: float) -> None:
    s = two_of_ours(steps)
    assert held_tokens(s, OUTPUT) + FITS_EXACTLY > CAPACITY  # so the finishing rule decides
    assert fits_as_they_finish(s, FITS_EXACTLY, OUTPUT, CAPACITY)
    assert not fits_as_they_finish(s, FITS_EXACTLY + 1, OUTPUT, CAPACITY)
    assert not ROOM.over(s, cost=FITS_EXACTLY, output=OUTPUT)
    assert ROOM.over(s, cost=FITS_EXACTLY + 1, output=OUTPUT)


def test_the_boundary_holds_for_part_steps_counted() -> None:
    # The endpoint's count is a quarter step into the current step: 1.75 and 2.75 steps to go are
    # at most 2 and 3 steps (a part step still runs), the same boundary as above.
    s = two_of_ours(steps=0.25, first=1.75, second=2.75)
    assert fits_as_they_finish(s, FITS_EXACTLY, OUTPUT, CAPACITY)
    assert not fits_as_they_finish(s, FITS_EXACTLY + 1, OUTPUT, CAPACITY)


def test_the_earlier_step_binds_when_the_second_is_done_with_the_first() -> None:
    # Both done by step 2: at k = 1 both run (prompt + 403), then nothing is left. One token
    # more than FITS_EXACTLY now fits (1024 - 403 + 3), two do not.
    s = two_of_ours(second=2.0)
    assert fits_as_they_finish(s, FITS_EXACTLY + 1, OUTPUT, CAPACITY)
    assert not fits_as_they_finish(s, FITS_EXACTLY + 2, OUTPUT, CAPACITY)
