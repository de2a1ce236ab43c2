"""The body-size limit through real Envoy: a body of exactly `limits.max_body_bytes` is served
(ext_proc's gRPC receive limit leaves room for it plus its attributes, a long x-request-id
included), and one byte more gets Envoy's JSON 413. At the default limit (4 MiB, gRPC's own
default receive limit) and above it (8 MiB), with the bootstrap rendered from the same config.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from modeldock.config import LimitsConfig
from tests.support.stack import API_KEY, RawResponse, Stack, raw_request, running_stack, wait_until

pytestmark = pytest.mark.e2e

DEFAULT = LimitsConfig().max_body_bytes
LONG_ID = "rid-" + "x" * 8000  # long, yet within the simulated backend's 8 KiB header line


def body_of(size: int) -> bytes:
    """A valid chat request of exactly `size` bytes."""
    base = {"model": "demo-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1, "pad": ""}
    empty = len(json.dumps(base).encode())
    base["pad"] = "p" * (size - empty)
    body = json.dumps(base).encode()
    assert len(body) == size
    return body


def send(stack: Stack, body: bytes, request_id: str | None = None) -> RawResponse:
    headers: list[tuple[str, Any]] = [("content-type", "application/json"), ("Authorization", f"Bearer {API_KEY}")]
    if request_id is not None:
        headers.append(("x-request-id", request_id))
    return raw_request("POST", f"{stack.base_url}/chat/completions", body, headers, timeout=60)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("limit", [None, 8 * 1024 * 1024], ids=["default-4MiB", "8MiB"])
def test_a_body_of_exactly_the_limit_is_served_and_one_byte_more_is_413(tmp_path: Path, limit: int | None) -> None:
    def edit(data: dict[str, Any], _sims: Any) -> None:
        if limit is not None:
            data["limits"] = {"max_body_bytes": limit}

    size = limit or DEFAULT
    with running_stack(tmp_path, backends=1, edit_config=edit) as stack:
        sim = stack.sims[0]
        for n in (size - 300, size):  # within a few hundred bytes of the limit, and at it
            received = sim.stats()["received"]
            r = send(stack, body_of(n), request_id=LONG_ID)
            assert r.status == 200, (n, r.status, r.body[:300])
            assert r.json()["choices"], r.body[:300]
            assert sim.stats()["received"] == received + 1
        envoy_log = (stack.run_dir / "envoy.log").read_text(errors="replace")
        assert f"id={LONG_ID}" in envoy_log, "Envoy did not keep the long x-request-id"

        received = sim.stats()["received"]
        r = send(stack, body_of(size + 1))
        assert r.status == 413, r.body[:300]
        assert r.headers.get("content-type") == "application/json"
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
        assert str(size) in err["message"]
        assert sim.stats()["received"] == received
        # Still serving, and nothing left counted.
        assert send(stack, body_of(1024)).status == 200
        wait_until(lambda: stack.in_flight() == 0, 10, what="in-flight count back to 0")
        log = (stack.run_dir / "extproc.log").read_text(errors="replace")
        assert "Traceback" not in log and "RESOURCE_EXHAUSTED" not in log
