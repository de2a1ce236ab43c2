"""Incremental Server-Sent Events parsing from raw byte chunks.

The network hands us bytes cut at arbitrary places: in the middle of a line,
between the CR and LF of a CRLF, or inside a multi-byte UTF-8 character. The
parser buffers until a line is complete, so the events it yields do not depend
on where the cuts fell. It follows the WHATWG event-stream rules: lines end in
CRLF, LF or CR; a blank line dispatches the event; lines starting with ':' are
comments; several `data:` lines join with '\\n'; an event with no data is not
dispatched; an unterminated event at end of stream is dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class SSEEvent:
    data: str
    event: str = "message"
    id: str | None = None


class SSEParser:
    def __init__(self) -> None:
        self._buffer = bytearray()
        self._first_line = True
        # The last chunk ended in CR: an LF opening the next chunk is the same CRLF.
        self._after_cr = False
        self._data: list[str] = []
        self._event = ""
        self._last_id: str | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Add bytes; return the events that became complete."""
        if self._after_cr and chunk:
            self._after_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        self._buffer += chunk
        events: list[SSEEvent] = []
        start = 0
        while (match := _LINE_END.search(self._buffer, start)) is not None:
            line = bytes(self._buffer[start : match.start()])
            if match.group() == b"\r" and match.end() == len(self._buffer):
                self._after_cr = True
            start = match.end()
            event = self._line(line)
            if event is not None:
                events.append(event)
        del self._buffer[:start]
        return events

    def _line(self, raw: bytes) -> SSEEvent | None:
        if self._first_line:
            self._first_line = False
            raw = raw.removeprefix(_BOM)
        # Safe per line: UTF-8 never uses CR or LF bytes inside a character.
        line = raw.decode("utf-8", errors="replace")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._last_id = value
        # 'retry' and unknown fields are ignored, as the spec says.
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        if not data:
            return None
        return SSEEvent(data="\n".join(data), event=event or "message", id=self._last_id)
