"""Token counts for budgets: what a request used, and the one rule for what it is charged.

What a request may cost before it runs is the director's one estimate (`flowcontrol.cost.RequestCost`):
deliberately high (settling gives back what was not used), prompt tokens as the request body's bytes / 4
(`prompt_bound`: JSON punctuation and field names count too), plus the completion limit the client set,
or `limits.reserve_completion_tokens` when it set none, times the choices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Usage", "charge_for"]


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Of prompt_tokens, those the backend served from its prefix cache (`prompt_tokens_details.cached_tokens`):
    # priced at a model's cached-input rate. 0 when it reported none.
    cached_tokens: int = 0

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_mapping(cls, usage: object) -> Usage | None:
        """OpenAI's `usage` object (or a metadata struct with the same keys); None unless both counts are
        non-negative whole numbers (JSON numbers may arrive as floats, e.g. from protobuf Struct).
        `cached_tokens` (flat, or OpenAI's `prompt_tokens_details.cached_tokens`) counts when it is a whole
        number from 0 to prompt_tokens, else it is taken as 0."""
        if not isinstance(usage, Mapping):
            return None
        counts = []
        for name in ("prompt_tokens", "completion_tokens"):
            value = _count(usage.get(name))
            if value is None:
                return None
            counts.append(value)
        cached = usage.get("cached_tokens")
        details = usage.get("prompt_tokens_details")
        if cached is None and isinstance(details, Mapping):
            cached = details.get("cached_tokens")
        hit = _count(cached)
        return cls(counts[0], counts[1], hit if hit is not None and hit <= counts[0] else 0)


def _count(value: object) -> int | None:
    """A token count: a non-negative whole number (an int, or a float that is one), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < 0 or value != int(value):
        return None
    return int(value)


def charge_for(prompt: int, output: int, usage: Usage | None, *, sent: bool, backend_error: bool = False) -> Usage:
    """What a request is charged, the one settlement rule (budgets/README.md "The settlement rule").

    `prompt` and `output` are what was reserved for it (the prompt estimate and the output limit the
    forwarded body carried, all choices). The backend's reported usage is charged exactly. Without it: a
    body that never reached a backend costs nothing; one that did costs at least its prompt estimate, the
    prompt alone when the backend answered with an error (it generated nothing), else the whole reservation
    (the stream was cut, the client left, or no usage came: it may have generated up to its limit).
    """
    if usage is not None:
        return usage
    if not sent:
        return Usage(0, 0)
    return Usage(prompt, 0 if backend_error else output)
