"""Record factory for the usage tests."""

from __future__ import annotations

from typing import Any

from modeldock.usage import UsageRecord

BASE_TS = 1_700_000_000.0  # FakeClock's default wall time: 2023-11-14T22:13:20Z


def record(**overrides: Any) -> UsageRecord:
    fields: dict[str, Any] = {
        "ts": BASE_TS, "request_id": "r-1", "tenant": "acme", "model": "llama-8b",
        "served_model": "meta-llama/Llama-3.1-8B-Instruct", "endpoint": "10.0.0.7:8000",
        "prompt_tokens": 12, "completion_tokens": 34, "token_source": "reported", "status": 200,
    }
    fields.update(overrides)
    return UsageRecord(**fields)
