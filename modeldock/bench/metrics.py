"""Per-request timing records and the exact TTFT / TPOT / E2E definitions.

Everything here is pure: timestamps come in as arguments, so the semantics are
unit-tested without a network or a clock.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from modeldock.bench.sse import SSEEvent

Endpoint = Literal["chat", "completions"]

# Error kinds that are not HTTP statuses (HTTP errors use the status, e.g. "429").
TIMEOUT = "timeout"  # the per-request timeout expired
TRANSPORT = "transport"  # connect/send failed, or no response headers
TRUNCATED = "truncated"  # a 200 stream ended (cleanly or not) without [DONE]
STREAM_ERROR = "stream_error"  # the server sent an error object inside the stream
INVALID = "invalid"  # a data line that is not JSON, or not a stream at all
EMPTY = "empty"  # [DONE] arrived but no chunk carried any content

DONE = "[DONE]"


@dataclass
class RequestRecord:
    """What one request did, as perf_counter() timestamps taken at receipt."""

    index: int
    sent_at: float
    first_content_at: float | None = None
    last_content_at: float | None = None
    ended_at: float | None = None
    completion_tokens: int | None = None  # only ever from a real `usage` object
    prompt_tokens: int | None = None
    error: str | None = None  # None means the request completed
    detail: str | None = None  # a short description of the error, for the report

    @property
    def completed(self) -> bool:
        return self.error is None and self.ended_at is not None

    def fail(self, kind: str, detail: str | None = None) -> None:
        # The first failure is the cause; later ones are consequences.
        if self.error is None:
            self.error = kind
            self.detail = detail[:300] if detail else None


def ttft(record: RequestRecord) -> float | None:
    """Send → first chunk with non-empty content. None unless completed."""
    if not record.completed or record.first_content_at is None:
        return None
    return record.first_content_at - record.sent_at


def tpot(record: RequestRecord) -> float | None:
    """(last content − first content) ÷ (completion_tokens − 1), usage only.

    None without usage or with completion_tokens ≤ 1: SSE chunks are never
    counted as tokens, because servers batch several tokens per chunk.
    """
    tokens = record.completion_tokens
    if not record.completed or tokens is None or tokens <= 1:
        return None
    if record.first_content_at is None or record.last_content_at is None:
        return None
    return (record.last_content_at - record.first_content_at) / (tokens - 1)


def e2e(record: RequestRecord) -> float | None:
    """Send → end of stream ([DONE]). None unless completed."""
    if not record.completed or record.ended_at is None:
        return None
    return record.ended_at - record.sent_at


def chunk_content(payload: Any, endpoint: Endpoint) -> str:
    """The generated text a chunk carries: delta.content (chat) or text (completions)."""
    if not isinstance(payload, dict):
        return ""
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else None
    else:
        content = choice.get("text")
    return content if isinstance(content, str) else ""


class StreamObserver:
    """Turns the SSE events of one response into timestamps on its record."""

    def __init__(self, record: RequestRecord, endpoint: Endpoint, use_usage: bool) -> None:
        self.record = record
        self.endpoint = endpoint
        # Usage counts only when asked for, so TPOT never appears by accident.
        self.use_usage = use_usage
        self.done = False

    @property
    def finished(self) -> bool:
        """True once nothing more should be read: [DONE] or an error."""
        return self.done or self.record.error is not None

    def on_event(self, event: SSEEvent, at: float) -> None:
        if self.finished:
            return
        if event.data.strip() == DONE:
            self.done = True
            if self.record.first_content_at is None:
                self.record.fail(EMPTY, "stream finished without any content")
            else:
                self.record.ended_at = at
            return
        try:
            payload = json.loads(event.data)
        except ValueError:
            self.record.fail(INVALID, f"data is not JSON: {event.data[:100]!r}")
            return
        if event.event == "error" or (isinstance(payload, dict) and payload.get("error")):
            self.record.fail(STREAM_ERROR, event.data)
            return
        if chunk_content(payload, self.endpoint):
            if self.record.first_content_at is None:
                self.record.first_content_at = at
            self.record.last_content_at = at
        if self.use_usage and isinstance(payload, dict):
            self._take_usage(payload.get("usage"))

    def on_close(self) -> None:
        """The byte stream ended; without [DONE] that is a truncation."""
        if not self.finished:
            self.record.fail(TRUNCATED, "stream ended without [DONE]")

    def _take_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        completion = usage.get("completion_tokens")
        prompt = usage.get("prompt_tokens")
        # Servers that report usage on every chunk are cumulative: the last one wins.
        if isinstance(completion, int) and not isinstance(completion, bool):
            self.record.completion_tokens = completion
        if isinstance(prompt, int) and not isinstance(prompt, bool):
            self.record.prompt_tokens = prompt
