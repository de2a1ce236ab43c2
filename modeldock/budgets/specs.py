"""Which budgets a request is subject to, how each counts it, and which one binds.

    specs = budget_specs(tenant, served_model, now, periods, limits.budget_timezone, price, minute_s=60)

Each `Spec` is one budget: its window (key, limit, length; a negative length is a calendar period's
counter, period.py), the config field that set it (the name `x-ratelimit-binding-tokens`
reports), its unit (`tokens`, or `cost` in millionths of the price's currency) and, for a period, the
instant it ends (the reset and Retry-After count to it).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from modeldock.admission.window import Decision, binding
from modeldock.budgets.period import PeriodKind, Periods, period_window
from modeldock.budgets.pricing import Price
from modeldock.budgets.redis_window import budget_key
from modeldock.budgets.window import BudgetLimit, Shape, most_that_fits, shaped
from modeldock.config import TenantConfig

Unit = Literal["tokens", "cost"]
_BIG = 1 << 62


@dataclass(frozen=True, slots=True)
class Spec:
    limit: BudgetLimit
    field: str  # tokens_per_minute, tokens_per_day, tokens_per_month, tokens_per_minute_per_model:<glob>, ...
    label: str  # for messages
    unit: Unit
    ends_at: float = 0.0  # a period's end (epoch seconds); 0 for a sliding window


@dataclass(frozen=True, slots=True)
class Plan:
    """A request's budgets and what the request path needs of them, computed once per (tenant, model)
    and period (TokenBudgets caches it until `until`, the first end of its periods)."""

    specs: list[Spec]
    limits: list[BudgetLimit]
    keys: list[tuple[str, float]]
    units: tuple[bool, ...]  # per budget: True for a cost budget
    costed: bool
    periods: bool
    least_limit: int  # the smallest token limit (a token-only request too large for it is refused)
    until: float

    @classmethod
    def of(cls, specs: list[Spec]) -> Plan:
        limits = [spec.limit for spec in specs]
        units = tuple(spec.unit == "cost" for spec in specs)
        return cls(specs, limits, [(key, window) for key, _, window in limits], units, any(units),
                   any(spec.ends_at for spec in specs),
                   min((limit for (_, limit, _), cost in zip(limits, units, strict=True) if not cost), default=0),
                   min((spec.ends_at for spec in specs if spec.ends_at), default=float("inf")))


def matching_budgets(per_model: Mapping[str, int], model: str) -> list[tuple[str, int]]:
    """Every (pattern, limit) whose glob matches `model` (the served name), in pattern order.

    Each pattern is one budget shared by all the models it matches, and every
    matching pattern applies (like the tenant budget applies beside them).
    """
    return sorted((p, limit) for p, limit in per_model.items() if limit > 0 and fnmatch.fnmatchcase(model, p))


def has_budgets(tenant: TenantConfig) -> bool:
    """Whether any token or cost budget is set for the tenant (a cheap check for the request path)."""
    return bool(tenant.tokens_per_minute or tenant.tokens_per_day or tenant.tokens_per_minute_per_model
                or tenant.tokens_per_month or tenant.cost_per_month or tenant.cost_per_day)


def budget_specs(
    tenant: TenantConfig, model: str, now: float, periods: Periods, default_tz: str, price: Price | None,
    *, minute_s: float = 60.0,
) -> list[Spec]:
    """The budgets that apply to a request for served model `model` at wall time `now`."""
    out: list[Spec] = []
    tid = tenant.id
    if tenant.tokens_per_minute > 0:
        out.append(Spec((budget_key(tid, "minute"), tenant.tokens_per_minute, minute_s), "tokens_per_minute",
                        f"tokens per minute for tenant {tid}", "tokens"))
    tz = tenant.budget_timezone or default_tz
    for kind, limit, unit in (("day", tenant.tokens_per_day, "tokens"), ("month", tenant.tokens_per_month, "tokens"),
                              ("day", to_limit(tenant.cost_per_day), "cost"),
                              ("month", to_limit(tenant.cost_per_month), "cost")):
        if limit <= 0 or (unit == "cost" and price is None):
            continue  # config validation requires a price wherever a cost budget applies
        k: PeriodKind = "day" if kind == "day" else "month"
        period = periods.current(k, now, tz)
        name = f"{'cost' if unit == 'cost' else 'tokens'}_per_{kind}"
        key = budget_key(tid, f"{kind}:{period.label}" if unit == "tokens" else f"cost:{kind}:{period.label}")
        out.append(Spec((key, limit, period_window(k)), name, f"{name.replace('_', ' ')} for tenant {tid}",
                        "cost" if unit == "cost" else "tokens", period.end))
    for pattern, limit in matching_budgets(tenant.tokens_per_minute_per_model, model):
        out.append(Spec((budget_key(tid, f"minute:model:{pattern}"), limit, minute_s),
                        f"tokens_per_minute_per_model:{pattern}",
                        f"tokens per minute for tenant {tid} on models {pattern}", "tokens"))
    return out


def to_limit(amount: float) -> int:
    """A cost budget's limit in millionths (rounded down: never more than configured)."""
    return int(amount * 1_000_000 + 1e-6)


def shapes_for(specs: Sequence[Spec], prompt: int, price: Price | None) -> list[Shape]:
    """How each budget counts an output grant g: prompt + g tokens, or the ceiling price in millionths."""
    out: list[Shape] = []
    for spec in specs:
        if spec.unit == "cost" and price is not None:
            out.append((prompt * price.input, price.output))
        else:
            out.append((prompt, 1.0))  # an int base: the exact path of `shaped`
    return out


def with_period_times(
    specs: Sequence[Spec], decisions: Sequence[Decision], now: float, needs: Sequence[int] = ()
) -> list[Decision]:
    """A period's counter resets at the period's end; a refused request whose `needs` (per budget) does
    not fit a counter can retry only then."""
    out = list(decisions)
    for i, spec in enumerate(specs):
        if spec.ends_at:
            left = max(spec.ends_at - now, 0.0)
            d = out[i]
            short = not d.allowed and bool(needs) and d.remaining < needs[i]
            out[i] = Decision(d.allowed, d.limit, d.remaining, left, left if short else 0.0, d.at)
    return out


def binding_index(decisions: Sequence[Decision], shapes: Sequence[Shape], grant: int) -> int:
    """Refused: the budget that takes longest to clear. Admitted: the one that allows the least further
    output (the budget that capped it, when capped), in output tokens so token and cost budgets compare."""
    if not decisions[0].allowed:
        return binding(decisions)

    def room(i: int) -> tuple[int, float]:
        d, shape = decisions[i], shapes[i]
        return most_that_fits(shape, d.remaining + shaped(shape, grant), _BIG), -d.reset_after_s

    return min(range(len(decisions)), key=room)
