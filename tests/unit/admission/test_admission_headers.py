from __future__ import annotations

import pytest

from modeldock.admission.headers import format_duration, ratelimit_headers, rejection_headers, retry_after
from modeldock.admission.window import Decision


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (-1, "0s"),
        (0.35, "350ms"),
        (0.0004, "1ms"),  # rounded up: never tell a client to come back early
        (0.999, "999ms"),
        (1, "1s"),
        (12, "12s"),
        (8.64, "8.64s"),
        (59.9999, "1m0s"),
        (60, "1m0s"),
        (72.5, "1m12.5s"),
        (3600, "1h0m0s"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "1"), (0.001, "1"), (1, "1"), (1.0000001, "1"), (1.2, "2"), (59.5, "60"), (60, "60")],
)
def test_retry_after_is_whole_seconds_at_least_one(seconds: float, text: str) -> None:
    assert retry_after(seconds) == text


def test_header_sets() -> None:
    ok = Decision(allowed=True, limit=10, remaining=3, reset_after_s=12.0, retry_after_s=0.0)
    assert ratelimit_headers(ok) == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "12s",
    }
    no = Decision(allowed=False, limit=10, remaining=0, reset_after_s=59.5, retry_after_s=2.5)
    assert rejection_headers(no) == {
        "Retry-After": "3",
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "59.5s",
    }
