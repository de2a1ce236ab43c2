"""OpenAI-style rate-limit headers."""

from __future__ import annotations

import math

from modeldock.admission.window import Decision

LIMIT = "x-ratelimit-limit-requests"
REMAINING = "x-ratelimit-remaining-requests"
RESET = "x-ratelimit-reset-requests"
RETRY_AFTER = "Retry-After"


def _whole_ms(seconds: float) -> int:
    # Round to microseconds first so 0.35 s is 350 ms, not 351; then round up so
    # a client that waits the advertised time is never early.
    return max(math.ceil(round(seconds * 1000, 3)), 0)


def format_duration(seconds: float) -> str:
    """Go-style duration as OpenAI sends it: "350ms", "12s", "8.64s", "1m0s", "1m12.5s"."""
    ms = _whole_ms(seconds)
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = str(ms // 1000) if ms % 1000 == 0 else f"{ms / 1000:.3f}".rstrip("0")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def retry_after(seconds: float) -> str:
    """Whole seconds, at least 1, rounded up (Retry-After takes no fractions)."""
    return str(max(1, math.ceil(_whole_ms(seconds) / 1000)))


def ratelimit_headers(decision: Decision) -> dict[str, str]:
    return {
        LIMIT: str(decision.limit),
        REMAINING: str(decision.remaining),
        RESET: format_duration(decision.reset_after_s),
    }


def rejection_headers(decision: Decision) -> dict[str, str]:
    return {RETRY_AFTER: retry_after(decision.retry_after_s), **ratelimit_headers(decision)}
