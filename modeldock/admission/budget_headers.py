"""OpenAI-style token rate-limit headers (the `-tokens` twins of headers.py's `-requests`)."""

from __future__ import annotations

from modeldock.admission.headers import RETRY_AFTER, format_duration, retry_after
from modeldock.admission.window import Decision

LIMIT_TOKENS = "x-ratelimit-limit-tokens"
REMAINING_TOKENS = "x-ratelimit-remaining-tokens"
RESET_TOKENS = "x-ratelimit-reset-tokens"


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
