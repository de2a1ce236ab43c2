"""Per-model rate limits through real Envoy with local windows only (no Redis): a public alias
counts in the window of the model it serves, so it cannot be used to get around that model's
limit. (tests/e2e/test_admission.py checks the same with the windows shared in Redis.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.stack import API_KEY, running_stack, wait_until

pytestmark = pytest.mark.e2e

LIMIT = 3
MSG = [{"role": "user", "content": "hello"}]


@pytest.mark.timeout(180)
def test_an_alias_counts_in_the_served_models_local_window(tmp_path: Path) -> None:
    def edit(data: dict[str, Any], sims: Any) -> None:
        data["tenants"][0]["requests_per_minute_per_model"] = {"demo-model": LIMIT}
        data["models"].append({"name": "demo-b", "served_name": "demo-model", "endpoints": [s.address for s in sims]})

    # REDIS_URL emptied: whatever the test runner's environment says, these windows are local.
    with running_stack(tmp_path, backends=1, edit_config=edit, extproc_env={"REDIS_URL": ""}) as stack:
        client = stack.openai(api_key=API_KEY, timeout=30)
        outcomes: list[tuple[str, int, str]] = []
        for model in ["demo-model", "demo-b", "demo-b", "demo-b", "demo-model", "demo-b"]:
            try:
                raw = client.chat.completions.with_raw_response.create(model=model, messages=MSG, max_tokens=1)
                outcomes.append((model, raw.status_code, raw.headers["x-ratelimit-remaining-requests"]))
            except openai.RateLimitError as exc:
                assert exc.body["code"] == "rate_limit_exceeded"
                assert "on model demo-model" in exc.body["message"]
                outcomes.append((model, 429, exc.response.headers["x-ratelimit-remaining-requests"]))
        assert outcomes == [
            ("demo-model", 200, "2"), ("demo-b", 200, "1"), ("demo-b", 200, "0"),
            ("demo-b", 429, "0"), ("demo-model", 429, "0"), ("demo-b", 429, "0"),
        ]
        assert stack.sims[0].stats()["received"] == LIMIT
        wait_until(lambda: stack.in_flight() == 0, 10, what="in-flight count back to 0")
