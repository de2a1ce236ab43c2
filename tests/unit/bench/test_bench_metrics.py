from __future__ import annotations

import json
from typing import Any

import pytest

from modeldock.bench.metrics import (
    EMPTY,
    INVALID,
    STREAM_ERROR,
    TRUNCATED,
    RequestRecord,
    StreamObserver,
    e2e,
    tpot,
    ttft,
)
from modeldock.bench.sse import SSEEvent


def chat(content: str | None = None, role: bool = False) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    return {"choices": [{"index": 0, "delta": delta}]}


def usage(completion: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": completion}}


def observe(
    timeline: list[tuple[float, Any]],
    *,
    endpoint: str = "chat",
    use_usage: bool = True,
    close: bool = False,
    sent_at: float = 100.0,
) -> RequestRecord:
    """Feed (time, payload) pairs; payload "[DONE]" or a dict (sent as JSON) or an SSEEvent."""
    record = RequestRecord(index=0, sent_at=sent_at)
    observer = StreamObserver(record, endpoint, use_usage)  # type: ignore[arg-type]
    for at, payload in timeline:
        if isinstance(payload, SSEEvent):
            event = payload
        else:
            event = SSEEvent(data=payload if isinstance(payload, str) else json.dumps(payload))
        observer.on_event(event, at)
    if close:
        observer.on_close()
    return record


def test_ttft_ignores_role_only_and_empty_chunks() -> None:
    record = observe(
        [
            (100.010, chat(role=True)),  # role-only: no content at all
            (100.020, chat("")),  # empty content
            (100.030, chat(None)),  # content missing
            (100.250, chat("Hello")),
            (100.300, chat(" world")),
            (100.310, "[DONE]"),
        ]
    )
    assert ttft(record) == pytest.approx(0.250)
    assert e2e(record) == pytest.approx(0.310)


def test_ttft_for_completions_reads_text() -> None:
    record = observe(
        [
            (100.05, {"choices": [{"text": ""}]}),
            (100.40, {"choices": [{"text": "Once"}]}),
            (100.50, "[DONE]"),
        ],
        endpoint="completions",
    )
    assert ttft(record) == pytest.approx(0.40)


def test_chat_field_names_do_not_cross_endpoints() -> None:
    # A completions-shaped chunk has no delta.content, so chat must not see content.
    record = observe([(100.1, {"choices": [{"text": "x"}]}), (100.2, "[DONE]")], endpoint="chat")
    assert record.error == EMPTY


def test_tpot_is_null_without_usage_however_many_chunks() -> None:
    timeline: list[tuple[float, Any]] = [(100.0 + i / 10, chat(f"t{i}")) for i in range(1, 9)]
    record = observe([*timeline, (101.0, "[DONE]")], use_usage=True)
    assert record.completed
    assert record.completion_tokens is None
    assert tpot(record) is None


def test_tpot_uses_usage_tokens_not_chunk_count() -> None:
    # 3 content chunks, but the server says 11 tokens: chunks carried several tokens each.
    record = observe(
        [
            (100.2, chat("a")),
            (100.6, chat("bcd")),
            (101.2, chat("efg")),
            (101.21, usage(11)),
            (101.22, "[DONE]"),
        ]
    )
    assert record.completion_tokens == 11
    assert tpot(record) == pytest.approx((101.2 - 100.2) / 10)
    assert ttft(record) == pytest.approx(0.2)
    assert e2e(record) == pytest.approx(1.22)


def test_usage_is_ignored_unless_it_was_asked_for() -> None:
    record = observe([(100.2, chat("a")), (100.9, chat("b")), (101.0, usage(5)), (101.1, "[DONE]")], use_usage=False)
    assert record.completion_tokens is None
    assert tpot(record) is None


@pytest.mark.parametrize("tokens", [0, 1])
def test_tpot_is_null_for_one_token_or_fewer(tokens: int) -> None:
    record = observe([(100.2, chat("a")), (100.3, usage(tokens)), (100.4, "[DONE]")])
    assert record.completion_tokens == tokens
    assert tpot(record) is None


def test_stream_closed_without_done_is_truncated_and_untimed() -> None:
    record = observe([(100.1, chat("a")), (100.2, chat("b")), (100.25, usage(2))], close=True)
    assert record.error == TRUNCATED
    assert not record.completed
    assert ttft(record) is None and tpot(record) is None and e2e(record) is None


def test_done_without_content_is_an_error() -> None:
    record = observe([(100.1, chat(role=True)), (100.2, "[DONE]")], close=True)
    assert record.error == EMPTY
    assert ttft(record) is None and e2e(record) is None


def test_error_object_inside_stream() -> None:
    record = observe([(100.1, chat("a")), (100.2, {"error": {"message": "boom"}}), (100.3, "[DONE]")])
    assert record.error == STREAM_ERROR
    assert e2e(record) is None


def test_error_event_type_inside_stream() -> None:
    record = observe([(100.1, chat("a")), (100.2, SSEEvent(data="{}", event="error")), (100.3, "[DONE]")])
    assert record.error == STREAM_ERROR


def test_non_json_data_is_invalid() -> None:
    record = observe([(100.1, chat("a")), (100.2, "not json"), (100.3, "[DONE]")])
    assert record.error == INVALID


def test_first_failure_wins() -> None:
    record = RequestRecord(index=0, sent_at=0.0)
    record.fail("429", "slow down")
    record.fail("transport", "later")
    assert (record.error, record.detail) == ("429", "slow down")
