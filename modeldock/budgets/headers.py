"""OpenAI-style token rate-limit headers (the `-tokens` twins of headers.py's `-requests`), the binding
budget's name, and the `-cost` headers of cost budgets."""

from __future__ import annotations

from collections.abc import Sequence

from modeldock.admission.headers import RETRY_AFTER, format_duration, retry_after
from modeldock.admission.window import Decision

LIMIT_TOKENS = "x-ratelimit-limit-tokens"
REMAINING_TOKENS = "x-ratelimit-remaining-tokens"
RESET_TOKENS = "x-ratelimit-reset-tokens"
# Which budget binds (the config field, e.g. `tokens_per_month`, or `tokens_per_minute_per_model:<glob>`).
BINDING_TOKENS = "x-ratelimit-binding-tokens"
# The output limit the gateway wrote into the forwarded body, and why: `default` (the client set none:
# limits.reserve_completion_tokens) or `budget` (the tenant's remaining budget is smaller than asked).
OUTPUT_LIMIT = "x-modeldock-output-limit"
OUTPUT_LIMIT_REASON = "x-modeldock-output-limit-reason"
# Every header a routed request's response may carry from ext_proc's route metadata (Envoy's bootstrap
# adds each from `modeldock:<name>`; picker mode sends them itself). Add a new header here.
# A cost budget's limit, what is left after this reservation (in the price's currency) and its reset.
LIMIT_COST = "x-ratelimit-limit-cost"
REMAINING_COST = "x-ratelimit-remaining-cost"
RESET_COST = "x-ratelimit-reset-cost"
BUDGET_RESPONSE_HEADERS: tuple[str, ...] = (LIMIT_TOKENS, REMAINING_TOKENS, RESET_TOKENS, BINDING_TOKENS,
                                            OUTPUT_LIMIT, OUTPUT_LIMIT_REASON, LIMIT_COST, REMAINING_COST,
                                            RESET_COST)


def token_ratelimit_headers(decision: Decision) -> dict[str, str]:
    """Limit, tokens left after this reservation, and time until the window is empty again."""
    return {
        LIMIT_TOKENS: str(decision.limit),
        REMAINING_TOKENS: str(decision.remaining),
        RESET_TOKENS: format_duration(decision.reset_after_s),
    }


def token_rejection_headers(decision: Decision) -> dict[str, str]:
    """Adds Retry-After: whole seconds until the window frees enough tokens for the request."""
    return {RETRY_AFTER: retry_after(decision.retry_after_s), **token_ratelimit_headers(decision)}


def format_money(micros: int) -> str:
    """Millionths of a currency unit as a plain decimal (`12.5`, `0.000125`)."""
    whole, frac = divmod(max(micros, 0), 1_000_000)
    return f"{whole}.{frac:06d}".rstrip("0").rstrip(".") if frac else str(whole)


def budget_headers(
    budgets: Sequence[tuple[str, bool, Decision]], bound: int, *, rejected: bool = False
) -> dict[str, str]:
    """The headers for a request subject to `budgets`, each (config field, is a cost budget, decision);
    `bound` is the binding one. The -tokens headers report the binding budget when it counts tokens, else
    the token budget with the fewest left; the -cost headers the cost budget with the least left."""
    field, is_cost, decision = budgets[bound]
    costed = is_cost or any(cost for _, cost, _d in budgets)
    tokens = decision if not is_cost else _least([d for _, cost, d in budgets if not cost])
    out = {RETRY_AFTER: retry_after(decision.retry_after_s)} if rejected else {}
    if tokens is not None:
        out[LIMIT_TOKENS] = str(tokens.limit)
        out[REMAINING_TOKENS] = str(tokens.remaining)
        out[RESET_TOKENS] = format_duration(tokens.reset_after_s)
    out[BINDING_TOKENS] = field
    if not costed:
        return out
    money = decision if is_cost else _least([d for _, cost, d in budgets if cost])
    if money is not None:
        out[LIMIT_COST] = format_money(money.limit)
        out[REMAINING_COST] = format_money(money.remaining)
        out[RESET_COST] = format_duration(money.reset_after_s)
    return out


def _least(decisions: list[Decision]) -> Decision | None:
    return min(decisions, key=lambda d: (d.remaining, -d.reset_after_s)) if decisions else None
