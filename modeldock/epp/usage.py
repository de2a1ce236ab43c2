"""The backend's token usage, read from the response as it passes through picker mode.

A gateway modeldock did not configure has none of the bootstrap's usage filters or usage log, but
picker mode sees every response chunk: `UsageScanner` reads the `usage` object from them (the
final SSE event `{"choices":[],"usage":{...}}` of a stream, or a JSON body's `usage`), and drops
that event when the gateway asked for it and the client did not (`Routed.drop_usage`), as the
bootstrap's Lua filter does. Made only for a request that needs its usage, so other requests pay
nothing per chunk; one that does pays a substring search per chunk until an event mentions usage.

Bounds: an incomplete trailing SSE event is held (when dropping) until the next chunk completes it,
at most SSE_HOLD_BYTES (a longer one is no usage event: it goes on as it is); a JSON body is read
up to JSON_MAX_BYTES (beyond: no usage read, the request stays charged its reservation). Events
end with a blank line (`\\n\\n` or `\\r\\n\\r\\n`).
"""

from __future__ import annotations

import json
import re

from modeldock.budgets.tokens import Usage

SSE_HOLD_BYTES = 64 * 1024
JSON_MAX_BYTES = 1024 * 1024

_SPLIT = re.compile(rb"(\r?\n\r?\n)")  # an event's end, kept to join the events again
# Cheap tests before any parsing: an event that carries a usage object names both.
_USAGE = b'"usage"'
_PROMPT = b'"prompt_tokens"'


class UsageScanner:
    """Feed it every response chunk in order (`feed`); `usage` is the last valid usage object seen."""

    def __init__(self, *, sse: bool, drop: bool, hold: bool = True) -> None:
        """`sse`: a `text/event-stream` body (else JSON); `drop`: remove the usage event (SSE only);
        `hold`: the body comes in chunks that may split an event (FULL_DUPLEX_STREAMED), else each
        message is whole (BUFFERED)."""
        self.usage: Usage | None = None
        self.drops = drop and sse
        self._sse = sse
        self._hold = hold
        # SSE: bytes after the last complete event: not yet read; not yet sent either when dropping.
        self._held = b""
        self._json: list[bytes] | None = None if sse else []
        self._json_size = 0

    def feed(self, chunk: bytes, end: bool) -> bytes:
        """What goes on for this chunk: the chunk itself, or (dropping) the complete events held and in it,
        without the usage event; b"" while an incomplete event is held."""
        if not self._sse:
            self._collect(chunk, end)
            return chunk
        data = self._held + chunk if self._held else chunk
        cut = len(data) if end or (self.drops and not self._hold) else _last_boundary(data)
        if len(data) - cut > SSE_HOLD_BYTES:
            cut = len(data)  # too long for a usage event: on it goes, unread
        complete, self._held = data[:cut], data[cut:]
        out = self._scan(complete) if complete else complete
        return out if self.drops else chunk

    def _scan(self, events: bytes) -> bytes:
        if _USAGE not in events or _PROMPT not in events:
            return events  # the usual chunk: content only
        parts = _SPLIT.split(events)  # [event, end, event, end, ..., rest]
        kept: list[bytes] = []
        dropped = False
        for i in range(0, len(parts), 2):
            event = parts[i]
            end = parts[i + 1] if i + 1 < len(parts) else b""
            if _USAGE in event and self._read(_data(event)) and self.drops:
                dropped = True
                continue
            kept.append(event)
            kept.append(end)
        return b"".join(kept) if dropped else events

    def _read(self, payload: bytes) -> bool:
        """Take the usage of one event's data; True when it is the usage event (`choices` empty)."""
        found = _parse(payload)
        if found is None:
            return False
        usage = Usage.from_mapping(found.get("usage"))
        if usage is None:
            return False
        self.usage = usage
        return found.get("choices") == []

    def _collect(self, chunk: bytes, end: bool) -> None:
        if self._json is None:
            return
        self._json_size += len(chunk)
        if self._json_size > JSON_MAX_BYTES:
            self._json = None  # too large to read: the reservation stands
            return
        self._json.append(chunk)
        if end:
            found = _parse(b"".join(self._json))
            self._json = None
            if found is not None:
                self.usage = Usage.from_mapping(found.get("usage")) or self.usage


def _last_boundary(data: bytes) -> int:
    """The offset just past the last event end in `data` (0: none)."""
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


def _data(event: bytes) -> bytes:
    """An SSE event's data: its `data:` lines, joined by newlines."""
    lines = []
    for line in event.split(b"\n"):
        line = line.rstrip(b"\r")
        if line.startswith(b"data:"):
            lines.append(line[6:] if line[5:6] == b" " else line[5:])
    return b"\n".join(lines)


def _parse(payload: bytes) -> dict[str, object] | None:
    if not payload:
        return None
    try:
        found = json.loads(payload)
    except (ValueError, RecursionError):
        return None
    return found if isinstance(found, dict) else None
