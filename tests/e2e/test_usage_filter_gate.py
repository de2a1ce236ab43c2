"""The usage filters cost nothing for a request that needs no usage (Envoy 1.40, the gateway's own bootstrap).

Pins what modeldock/envoy.py (`_usage_matcher`, `USAGE_MARK_HEADER`) relies on, docs/envoy.md:
- an `ExtensionWithMatcher` on `HttpResponseHeaderMatchInput` with `not_matcher` -> `SkipFilter` skips the
  wrapped filter for a response without the mark: the Lua filter never runs and neither `json_to_metadata`
  (non-streaming) nor `sse_to_metadata` (streams; an encoder-only filter) reads a byte of it;
- the route's `response_headers_to_add` writes `modeldock:usage` as the mark before the encoder filters
  see the response, and adds nothing when the metadata is absent;
- with the mark, all three run: the usage is read and a usage event the client did not ask for is dropped;
- the client never sees the mark.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modeldock.config import hash_key
from modeldock.envoy import USAGE_MARK_HEADER
from tests.support.stack import API_KEY, Stack, running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
BUDGET_KEY = "md-test-gate-budgeted-key"
FILTER_STATS = ("http.modeldock.lua.executions", "json_to_metadata.resp.success",
                "json_to_metadata.resp.mismatched_content_type", "sse_to_metadata.resp.json.metadata_added",
                "sse_to_metadata.resp.json.parse_error", "sse_to_metadata.resp.json.mismatched_content_type")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    def edit(data: dict[str, Any], _sims: object) -> None:
        data["tenants"].append({"id": "budgeted", "api_key_hashes": [hash_key(BUDGET_KEY)], "models": ["demo-*"],
                                "tokens_per_minute": 10**9})
    with running_stack(Path(tmp_path_factory.mktemp("gate")), backends=1, sim_args=("--speed", "1000"),
                       log_level="info", edit_config=edit) as running:
        yield running


def filter_stats(stack: Stack) -> dict[str, int]:
    return {name: stack.envoy_stat(name) for name in FILTER_STATS}


def chat(stack: Stack, key: str, stream: bool) -> tuple[dict[str, str], bytes]:
    body = json.dumps({"model": "demo-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                       "stream": stream}).encode()
    request = urllib.request.Request(f"{stack.base_url}/chat/completions", data=body, method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:  # noqa: S310
        return {k.lower(): v for k, v in resp.headers.items()}, resp.read()


def test_a_request_without_usage_passes_no_usage_filter(stack: Stack) -> None:
    before = filter_stats(stack)
    for stream in (False, True, False, True):
        headers, body = chat(stack, API_KEY, stream)
        assert USAGE_MARK_HEADER not in headers
        assert body  # a whole reply: the skipped filters passed it on
    assert filter_stats(stack) == before


def test_a_request_marked_for_usage_passes_all_three(stack: Stack) -> None:
    before = filter_stats(stack)
    headers, _ = chat(stack, BUDGET_KEY, stream=False)
    assert USAGE_MARK_HEADER not in headers
    headers, body = chat(stack, BUDGET_KEY, stream=True)
    assert USAGE_MARK_HEADER not in headers
    # The gateway asked for usage the client did not: Lua dropped that event, after sse_to_metadata read it.
    events = [line for line in body.split(b"\n") if line.startswith(b"data: {")]
    assert events and not any(b'"usage":{' in e and b'"choices":[]' in e for e in events)
    after = filter_stats(stack)
    assert after["http.modeldock.lua.executions"] == before["http.modeldock.lua.executions"] + 2
    assert after["json_to_metadata.resp.success"] == before["json_to_metadata.resp.success"] + 1
    assert after["sse_to_metadata.resp.json.metadata_added"] > before["sse_to_metadata.resp.json.metadata_added"]
