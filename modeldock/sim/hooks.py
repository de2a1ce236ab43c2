"""Test hooks: what the simulator received, and failures it can be told to produce."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal, cast

from aiohttp import web

FaultMode = Literal["none", "status_503", "reset_before_headers", "die_after_chunks"]
FAULT_MODES: tuple[FaultMode, ...] = ("none", "status_503", "reset_before_headers", "die_after_chunks")
REQUEST_LOG_SIZE = 100


@dataclass(frozen=True)
class Fault:
    mode: FaultMode
    chunks: int = 0  # for die_after_chunks: SSE events sent before the connection is cut


NO_FAULT = Fault("none")


class FaultPlan:
    """The failure to inject into the next `count` inference requests (None: until reset)."""

    def __init__(self) -> None:
        self._fault = NO_FAULT
        self._remaining: int | None = None

    def set(self, fault: Fault, count: int | None) -> None:
        self._fault = fault
        self._remaining = count
        if fault.mode == "none" or count == 0:
            self._fault, self._remaining = NO_FAULT, None

    def take(self) -> Fault:
        fault = self._fault
        if fault.mode != "none" and self._remaining is not None:
            self._remaining -= 1
            if self._remaining <= 0:
                self._fault, self._remaining = NO_FAULT, None
        return fault

    def describe(self) -> dict[str, Any]:
        return {"mode": self._fault.mode, "chunks": self._fault.chunks, "count": self._remaining}


def parse_fault(body: Any) -> tuple[Fault, int | None]:
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    mode = body.get("mode", "none")
    if mode not in FAULT_MODES:
        raise ValueError(f"mode must be one of {', '.join(FAULT_MODES)}")
    chunks = body.get("chunks", 0)
    count = body.get("count")
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 0:
        raise ValueError("chunks must be a non-negative integer")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
        raise ValueError("count must be a non-negative integer or null")
    return Fault(cast(FaultMode, mode), chunks), count


class RequestLog:
    """The last REQUEST_LOG_SIZE requests, oldest first, headers exactly as received."""

    def __init__(self) -> None:
        self._entries: deque[dict[str, Any]] = deque(maxlen=REQUEST_LOG_SIZE)

    async def record(self, request: web.Request, wall_time: float) -> None:
        raw = await request.read()  # aiohttp keeps the body, so the handler can read it again
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        self._entries.append(
            {
                "time": wall_time,
                "method": request.method,
                "path": request.path,
                "query": request.query_string,
                "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in request.raw_headers],
                "body": body,
            }
        )

    def entries(self) -> list[dict[str, Any]]:
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()


async def read_json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read() or b"null")
    except ValueError as exc:
        raise web.HTTPBadRequest(
            text=json.dumps({"error": f"invalid JSON: {exc}"}), content_type="application/json"
        ) from exc
