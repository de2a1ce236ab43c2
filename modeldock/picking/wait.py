"""Predicted wait: how long the work already sent to an endpoint takes at its own speed."""

from __future__ import annotations

from modeldock.picking.scorers import SignalScorer, saturating
from modeldock.picking.signals import Signals

# Until two pages of an endpoint's token counters were read while it was busy: a modest vLLM
# server's throughput (tokens/s, prompt + output), so an unknown endpoint is neither preferred
# nor shunned for long.
DEFAULT_SPEED = 2000.0


class PredictedWait(SignalScorer):
    """Seconds to get through the tokens committed there (this gateway's requests in flight),
    plus the requests the sample shows waiting at the average committed size, at the
    endpoint's own speed (vllm:prompt_tokens_total + generation_tokens_total over time, while
    busy). A slower backend is recognised without configuration: the same work takes it
    longer. Normalised x / (x + half), half = 2 s."""

    name = "predicted_wait"

    def __init__(self, half: float = 2.0, default_speed: float = DEFAULT_SPEED) -> None:
        self.half = half
        self.default_speed = default_speed

    def __call__(self, s: Signals) -> float:
        ahead = float(s.committed)
        # The server's own queue as the sample saw it (the corrected `waiting` also counts
        # this gateway's picks since, which `committed` holds already).
        queued = s.sample.waiting if s.fresh and s.sample is not None else 0.0
        if queued > 0 and s.in_flight:
            ahead += queued * s.committed / s.in_flight
        speed = s.speed if s.speed > 0 else self.default_speed
        return saturating(ahead / speed, self.half)
