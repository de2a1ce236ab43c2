"""OpenAI-style token rate-limit headers (the `-tokens` twins of headers.py's `-requests`)."""

from __future__ import annotations

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
BUDGET_RESPONSE_HEADERS: tuple[str, ...] = (LIMIT_TOKENS, REMAINING_TOKENS, RESET_TOKENS, BINDING_TOKENS,
                                            OUTPUT_LIMIT, OUTPUT_LIMIT_REASON)


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
