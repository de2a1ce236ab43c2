"""Token counts for budgets: what a request may cost before it runs, and what it used.

The estimate is deliberately high (settling gives back what was not used):
prompt tokens as the request body's bytes / 4 (JSON punctuation and field names
count too), plus the completion limit the client set, or
`limits.reserve_completion_tokens` when it set none, times `n`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

BYTES_PER_TOKEN = 4
MAX_CHOICES = 128


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def from_mapping(cls, usage: object) -> Usage | None:
        """OpenAI's `usage` object (or a metadata struct with the same keys); None unless both counts are
        non-negative whole numbers (JSON numbers may arrive as floats, e.g. from protobuf Struct)."""
        if not isinstance(usage, Mapping):
            return None
        counts = []
        for name in ("prompt_tokens", "completion_tokens"):
            value = usage.get(name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                return None
            if not math.isfinite(value) or value < 0 or value != int(value):
                return None
            counts.append(int(value))
        return cls(counts[0], counts[1])


def estimate_cost(request: Mapping[str, object], body_bytes: int, reserve_completion_tokens: int) -> int:
    """Tokens to reserve for a parsed chat/completions request whose body was `body_bytes` long."""
    prompt = math.ceil(max(body_bytes, 0) / BYTES_PER_TOKEN)
    completion = reserve_completion_tokens
    for name in ("max_completion_tokens", "max_tokens"):
        value = request.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            completion = value
            break
    n = request.get("n", 1)
    choices = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_CHOICES else 1
    return prompt + completion * choices
