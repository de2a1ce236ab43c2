"""One usage record per answered request, written as one JSON line (format version 1).

The format is documented in modeldock/usage/README.md. Within version 1 fields may be
added (readers ignore unknown keys); renaming, removing or changing the meaning of a
field bumps `v`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

FORMAT_VERSION = 1
TokenSource = Literal["reported", "estimated"]
TOKEN_SOURCES: frozenset[str] = frozenset(("reported", "estimated"))
# A client's x-request-id is only for correlation; cap it so a client cannot bloat the log.
MAX_CLIENT_ID = 128


class RecordError(ValueError):
    """A line that is not a usage record this version can read."""


class UnsupportedVersion(RecordError):
    """A record of another format version."""


def new_request_id() -> str:
    """A gateway-side request id (the client cannot choose it, unlike x-request-id)."""
    return uuid.uuid4().hex


def rfc3339(epoch: float) -> str:
    """`2025-01-31T12:00:00.123Z`: UTC, millisecond precision."""
    whole = int(epoch)
    millis = int(round((epoch - whole) * 1000))
    if millis == 1000:
        whole, millis = whole + 1, 0
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """What one request used. `ts` is wall-clock epoch seconds when the request ended."""

    ts: float
    request_id: str  # the gateway's own id
    tenant: str  # from authentication, never from a client header
    model: str  # the public name the client asked for
    served_model: str  # the name the backend knows
    endpoint: str  # ip:port that served it; "" if none was picked
    prompt_tokens: int
    completion_tokens: int
    token_source: TokenSource  # "reported" by the backend's usage, or "estimated" by the gateway
    status: int  # HTTP status the client got; 0 if the client went away before one was sent
    cancelled: bool = False  # the client went away before the response ended
    retries: int = 0  # attempts Envoy retried on another endpoint
    client_request_id: str = ""  # the client's x-request-id, for correlation only
    replica: str = ""  # the gateway replica that wrote it

    def __post_init__(self) -> None:
        if len(self.client_request_id) > MAX_CLIENT_ID:
            object.__setattr__(self, "client_request_id", self.client_request_id[:MAX_CLIENT_ID])

    @property
    def is_error(self) -> bool:
        """An error the gateway or backend answered (a cancelled request is counted as cancelled instead)."""
        return self.status >= 400 and not self.cancelled

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": FORMAT_VERSION,
            "time": rfc3339(self.ts),
            "ts": round(self.ts, 3),
            "request_id": self.request_id,
            "client_request_id": self.client_request_id,
            "replica": self.replica,
            "tenant": self.tenant,
            "model": self.model,
            "served_model": self.served_model,
            "endpoint": self.endpoint,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "token_source": self.token_source,
            "status": self.status,
            "cancelled": self.cancelled,
            "retries": self.retries,
        }

    def to_json(self) -> str:
        """One ASCII line, no trailing newline: every control or non-ASCII character (U+0085, U+2028
        included) is escaped, so no value (a client's x-request-id) can split a line for any reader."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UsageRecord:
        if data.get("v") != FORMAT_VERSION:
            raise UnsupportedVersion(
                f"unsupported usage record version {data.get('v')!r} (this reader knows {FORMAT_VERSION})")
        try:
            ts = data["ts"] if "ts" in data else parse_time(str(data["time"]))
            source = str(data["token_source"])
            if source not in TOKEN_SOURCES:
                raise RecordError(f"token_source {source!r} is not one of {sorted(TOKEN_SOURCES)}")
            return cls(
                ts=float(ts),
                request_id=str(data["request_id"]),
                tenant=str(data["tenant"]),
                model=str(data["model"]),
                served_model=str(data.get("served_model", data["model"])),
                endpoint=str(data.get("endpoint", "")),
                prompt_tokens=_count(data, "prompt_tokens"),
                completion_tokens=_count(data, "completion_tokens"),
                token_source=source,  # type: ignore[arg-type]  # checked above
                status=_count(data, "status"),
                cancelled=bool(data.get("cancelled", False)),
                retries=_count(data, "retries", required=False),
                client_request_id=str(data.get("client_request_id", "")),
                replica=str(data.get("replica", "")),
            )
        except KeyError as exc:
            raise RecordError(f"usage record lacks {exc.args[0]!r}") from None

    @classmethod
    def from_json(cls, line: str) -> UsageRecord:
        try:
            data = json.loads(line)
        except ValueError as exc:
            raise RecordError(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise RecordError("not a JSON object")
        return cls.from_dict(data)


def _count(data: dict[str, Any], key: str, required: bool = True) -> int:
    value = data[key] if required else data.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RecordError(f"{key} must be a non-negative integer, got {value!r}")
    return value


def parse_time(text: str) -> float:
    """RFC 3339 (`2025-01-31T12:00:00Z`, any offset) or a date (`2025-01-31`) to epoch seconds.

    A time without an offset is taken as UTC.
    """
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not an RFC 3339 time (e.g. 2025-01-31T12:00:00Z) or a date") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()
