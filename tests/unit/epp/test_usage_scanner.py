"""Reading the backend's usage from a response as picker mode passes it on (modeldock/epp/usage.py)."""

from __future__ import annotations

import json

from modeldock.budgets.tokens import Usage
from modeldock.epp.usage import JSON_MAX_BYTES, SSE_HOLD_BYTES, UsageScanner

CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"hello"}}]}\n\n'
USAGE_EVENT = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12}}\n\n'
DONE = b"data: [DONE]\n\n"
STREAM = CONTENT + CONTENT + USAGE_EVENT + DONE


def feed_all(scanner: UsageScanner, chunks: list[bytes]) -> list[bytes]:
    return [scanner.feed(c, i == len(chunks) - 1) for i, c in enumerate(chunks)]


def test_the_usage_event_is_read_and_dropped_wherever_the_chunks_split_the_stream() -> None:
    for cut in range(1, len(STREAM)):
        for second in (cut, (cut + len(STREAM)) // 2):
            chunks = [c for c in (STREAM[:cut], STREAM[cut:second], STREAM[second:]) if c]
            scanner = UsageScanner(sse=True, drop=True)
            out = feed_all(scanner, chunks)
            assert b"".join(out) == CONTENT + CONTENT + DONE, (cut, second)
            assert scanner.usage == Usage(7, 5)


def test_without_dropping_every_chunk_goes_on_unchanged_and_the_usage_is_still_read() -> None:
    for cut in range(1, len(STREAM)):
        chunks = [STREAM[:cut], STREAM[cut:]]
        scanner = UsageScanner(sse=True, drop=False)
        assert feed_all(scanner, chunks) == chunks
        assert scanner.usage == Usage(7, 5), cut


def test_an_incomplete_event_is_held_only_until_the_chunk_that_completes_it() -> None:
    scanner = UsageScanner(sse=True, drop=True)
    assert scanner.feed(CONTENT + USAGE_EVENT[:20], False) == CONTENT  # the usage event's start is held
    assert scanner.feed(USAGE_EVENT[20:-1], False) == b""
    assert scanner.feed(USAGE_EVENT[-1:] + DONE[:4], False) == b""  # dropped; [DONE]'s start is held
    assert scanner.feed(DONE[4:], False) == DONE
    assert scanner.usage == Usage(7, 5)


def test_crlf_events_and_multi_line_data_are_read_too() -> None:
    usage = b'data: {"choices":[],\r\ndata: "usage":{"prompt_tokens":3,"completion_tokens":4}}\r\n\r\n'
    content = CONTENT.replace(b"\n\n", b"\r\n\r\n")
    scanner = UsageScanner(sse=True, drop=True)
    out = feed_all(scanner, [content + usage[:30], usage[30:], b"data: [DONE]\r\n\r\n"])
    assert b"".join(out) == content + b"data: [DONE]\r\n\r\n"
    assert scanner.usage == Usage(3, 4)


def test_usage_in_a_content_event_is_read_but_not_dropped_and_a_stream_without_usage_reads_none() -> None:
    with_usage = b'data: {"choices":[{"delta":{}}],"usage":{"prompt_tokens":2,"completion_tokens":9}}\n\n'
    scanner = UsageScanner(sse=True, drop=True)
    assert b"".join(feed_all(scanner, [CONTENT, with_usage, DONE])) == CONTENT + with_usage + DONE
    assert scanner.usage == Usage(2, 9)
    scanner = UsageScanner(sse=True, drop=True)
    broken = b'data: {"choices":[],"usage":{"prompt_tokens":-1,"completion_tokens":1}}\n\n'
    assert b"".join(feed_all(scanner, [CONTENT, broken, DONE])) == CONTENT + broken + DONE
    assert scanner.usage is None
    scanner = UsageScanner(sse=True, drop=True)
    assert b"".join(feed_all(scanner, [CONTENT, USAGE_EVENT[:30]])) == CONTENT + USAGE_EVENT[:30]  # cut: sent
    assert scanner.usage is None


def test_an_event_longer_than_the_hold_bound_goes_on_unread() -> None:
    scanner = UsageScanner(sse=True, drop=True)
    big = b"data: " + b"x" * SSE_HOLD_BYTES
    assert scanner.feed(big[:100], False) == b""
    assert scanner.feed(big[100:], False) == big  # past the bound: no longer held
    assert scanner.feed(b"\n\n" + USAGE_EVENT, True) == b"\n\n"
    assert scanner.usage == Usage(7, 5)


def test_a_buffered_body_is_whole_in_one_message() -> None:
    scanner = UsageScanner(sse=True, drop=True, hold=False)
    assert scanner.feed(STREAM, True) == CONTENT + CONTENT + DONE
    assert scanner.usage == Usage(7, 5)


def test_a_json_body_is_read_at_its_end_whatever_its_chunks_and_not_past_its_bound() -> None:
    body = json.dumps({"id": "x", "choices": [{"message": {"content": "hi"}}],
                       "usage": {"prompt_tokens": 11, "completion_tokens": 13,
                                 "prompt_tokens_details": {"cached_tokens": 4}}}).encode()
    scanner = UsageScanner(sse=False, drop=True)
    assert feed_all(scanner, [body[:9], body[9:40], body[40:]]) == [body[:9], body[9:40], body[40:]]
    assert scanner.usage == Usage(11, 13, 4)
    padded = body[:-1] + b', "pad": "' + b"x" * JSON_MAX_BYTES + b'"}'
    scanner = UsageScanner(sse=False, drop=False)
    feed_all(scanner, [padded[:JSON_MAX_BYTES // 2], padded[JSON_MAX_BYTES // 2:]])
    assert scanner.usage is None
    scanner = UsageScanner(sse=False, drop=False)
    feed_all(scanner, [b"not json"])
    assert scanner.usage is None
