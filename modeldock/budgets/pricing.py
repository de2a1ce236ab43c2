"""What a request costs in money: a model's price per million tokens applied to its usage.

Plain arithmetic, shared by cost budgets (reserve and settle) and usage records, so a record's
`cost` is exactly what a cost budget charged. Amounts are floats in the price's currency; budget
windows count them in millionths (`to_micros`), whole numbers like token amounts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from modeldock.budgets.tokens import Usage
from modeldock.config import ModelConfig

PER = 1_000_000  # prices are per million tokens


@dataclass(frozen=True, slots=True)
class Price:
    input: float  # per million prompt tokens not served from the prefix cache
    output: float  # per million completion tokens
    cached_input: float | None = None  # per million cached prompt tokens; None: the input price

    def of(self, usage: Usage) -> float:
        """The price of what a request used (cached prompt tokens at the cached rate)."""
        cached = min(max(usage.cached_tokens, 0), usage.prompt_tokens)
        cached_rate = self.input if self.cached_input is None else self.cached_input
        return ((usage.prompt_tokens - cached) * self.input + cached * cached_rate
                + usage.completion_tokens * self.output) / PER

    def ceiling(self, prompt_tokens: int, output_tokens: int) -> float:
        """The most a request of this size can cost: every prompt token at the full input rate."""
        return (prompt_tokens * self.input + output_tokens * self.output) / PER


def to_micros(amount: float) -> int:
    """A money amount in millionths, rounded up (a budget never under-counts)."""
    return math.ceil(amount * PER - 1e-9)


def model_price(model: ModelConfig) -> Price | None:
    """A model's own price (`models[].price`), the one the director passes budgets and records use;
    an alias without one has none, whatever the model it serves costs."""
    p = model.price
    return None if p is None else Price(p.input, p.output, p.cached_input)
