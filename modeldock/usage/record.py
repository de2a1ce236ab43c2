"""One usage record per request, written as one JSON line (format version 1).

The format is documented in modeldock/usage/README.md. Within version 1 fields may be
added (readers ignore unknown keys, and a field an older record lacks reads as its
default); renaming, removing or changing the meaning of a field bumps `v`.

Reading is strict about types (a record is read whole or refused with a RecordError whose
`reason` says why, e.g. "bad ts"), so a corrupted or hostile line can never crash a
reader or land in the wrong time range.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

FORMAT_VERSION = 1
TokenSource = Literal["reported", "estimated"]
TOKEN_SOURCES: frozenset[str] = frozenset(("reported", "estimated"))
# How a request ended (README "Termination"): "rejected" is a request the gateway refused itself.
Termination = Literal["completed", "client_disconnect", "upstream_error", "timeout", "rejected"]
TERMINATIONS: frozenset[str] = frozenset(("completed", "client_disconnect", "upstream_error", "timeout", "rejected"))
# A client's x-request-id is only for correlation; cap it so a client cannot bloat the log.
MAX_CLIENT_ID = 128
# Bounds a reader accepts: `ts` before year 10000 (so `time` can be written back), counts that fit an int64
# column in whatever database the records are shipped to.
MAX_TS = 253_402_300_800.0
MAX_COUNT = 2**63 - 1
MAX_STATUS = 999


class RecordError(ValueError):
    """A line that is not a usage record this version can read; `reason` is a short label to count by."""

    def __init__(self, message: str, reason: str = "not a record") -> None:
        super().__init__(message)
        self.reason = reason


class UnsupportedVersion(RecordError):
    """A record of another format version."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "other version")


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
    request_id: str  # the gateway's own id: unique per request, what a shipper deduplicates on
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
    cached_tokens: int = 0  # of prompt_tokens, those served from the backend's prefix cache
    cost: float | None = None  # in the configured price's currency; None when the model has no price
    termination: Termination = "completed"  # how the request ended (TERMINATIONS)
    response_bytes: int = 0  # body bytes the client received (what was streamed before a cut)

    def __post_init__(self) -> None:
        if len(self.client_request_id) > MAX_CLIENT_ID:
            object.__setattr__(self, "client_request_id", self.client_request_id[:MAX_CLIENT_ID])

    @property
    def is_rejected(self) -> bool:
        """The gateway refused the request itself (no backend was asked)."""
        return self.termination == "rejected"

    @property
    def is_error(self) -> bool:
        """An error answered to a request that was let in: status >= 400, not cancelled (counted as
        cancelled instead) and not rejected (counted as rejected instead)."""
        return self.status >= 400 and not self.cancelled and not self.is_rejected

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
            "cached_tokens": self.cached_tokens,
            "token_source": self.token_source,
            "cost": self.cost,
            "status": self.status,
            "cancelled": self.cancelled,
            "termination": self.termination,
            "response_bytes": self.response_bytes,
            "retries": self.retries,
        }

    def to_json(self) -> str:
        """One ASCII line, no trailing newline: every control or non-ASCII character (U+0085, U+2028
        included) is escaped, so no value (a client's x-request-id) can split a line for any reader."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> UsageRecord:
        """The record in `data`, or RecordError: every field is type-checked, none is coerced."""
        version = data.get("v")
        if isinstance(version, bool) or version != FORMAT_VERSION:
            raise UnsupportedVersion(
                f"unsupported usage record version {_show(version)} (this reader knows {FORMAT_VERSION})")
        source = _text(data, "token_source")
        if source not in TOKEN_SOURCES:
            raise RecordError(f"token_source {_show(source)} is not one of {sorted(TOKEN_SOURCES)}",
                              "bad token_source")
        # A record from before `termination` existed: a cancelled one ended with the client leaving.
        termination = _text(data, "termination", "client_disconnect" if _flag(data, "cancelled") else "completed")
        if termination not in TERMINATIONS:
            raise RecordError(f"termination {_show(termination)} is not one of {sorted(TERMINATIONS)}",
                              "bad termination")
        model = _text(data, "model")
        return cls(
            ts=_ts(data),
            request_id=_text(data, "request_id"),
            tenant=_text(data, "tenant"),
            model=model,
            served_model=_text(data, "served_model", model),
            endpoint=_text(data, "endpoint", ""),
            prompt_tokens=_count(data, "prompt_tokens"),
            completion_tokens=_count(data, "completion_tokens"),
            token_source=source,  # type: ignore[arg-type]  # checked above
            status=_count(data, "status", top=MAX_STATUS),
            cancelled=_flag(data, "cancelled"),
            retries=_count(data, "retries", 0),
            client_request_id=_text(data, "client_request_id", ""),
            replica=_text(data, "replica", ""),
            cached_tokens=_count(data, "cached_tokens", 0),
            cost=_cost(data),
            termination=termination,  # type: ignore[arg-type]  # checked above
            response_bytes=_count(data, "response_bytes", 0),
        )

    @classmethod
    def from_json(cls, line: str) -> UsageRecord:
        try:
            data = json.loads(line)
        except ValueError as exc:
            raise RecordError(f"not JSON: {exc}", "not JSON") from None
        except RecursionError:
            raise RecordError("not JSON: nested too deeply to parse", "not JSON") from None
        if not isinstance(data, dict):
            raise RecordError("not a JSON object", "not an object")
        return cls.from_dict(data)


_MISSING: Any = object()


def _field(data: dict[str, Any], key: str, default: Any) -> Any:
    value = data.get(key, default)
    if value is _MISSING:
        raise RecordError(f"usage record lacks {key!r}", f"missing {key}")
    return value


def _show(value: object) -> str:
    """A bad value in an error message: repr (escapes control characters), cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _text(data: dict[str, Any], key: str, default: Any = _MISSING) -> str:
    value = _field(data, key, default)
    if not isinstance(value, str):
        raise RecordError(f"{key} must be a string, got {_show(value)}", f"bad {key}")
    return value


def _count(data: dict[str, Any], key: str, default: Any = _MISSING, top: int = MAX_COUNT) -> int:
    value = _field(data, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise RecordError(f"{key} must be an integer from 0 to {top}, got {_show(value)}", f"bad {key}")
    return value


def _flag(data: dict[str, Any], key: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise RecordError(f"{key} must be true or false, got {_show(value)}", f"bad {key}")
    return value


def _finite(value: object, low: float, high: float) -> float | None:
    """`value` as a float when it is a JSON number within [low, high) (NaN and infinities are not), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        return None
    return number if low <= number < high else None  # NaN compares false, so it is never in range


def _ts(data: dict[str, Any]) -> float:
    """`ts` (epoch seconds) or, in a record without it, `time` (RFC 3339)."""
    if "ts" in data:
        ts = _finite(data["ts"], 0.0, MAX_TS)
        if ts is None:
            raise RecordError(f"ts must be epoch seconds (a number from 0 to {MAX_TS:.0f}), got {_show(data['ts'])}",
                              "bad ts")
        return ts
    text = _field(data, "time", _MISSING)
    try:
        if not isinstance(text, str):
            raise ValueError(f"time must be an RFC 3339 string, got {_show(text)}")
        ts = _finite(parse_time(text), 0.0, MAX_TS)
    except ValueError as exc:
        raise RecordError(str(exc), "bad time") from None
    if ts is None:
        raise RecordError(f"time {_show(text)} is out of range (1970 to 9999)", "bad time")
    return ts


def _cost(data: dict[str, Any]) -> float | None:
    value = data.get("cost")
    if value is None:
        return None
    cost = _finite(value, 0.0, math.inf)
    if cost is None:
        raise RecordError(f"cost must be null or a non-negative number, got {_show(value)}", "bad cost")
    return cost


def parse_time(text: str) -> float:
    """RFC 3339 (`2025-01-31T12:00:00Z`, any offset) or a date (`2025-01-31`) to epoch seconds.

    A time without an offset is taken as UTC.
    """
    try:
        moment = datetime.fromisoformat(text.strip())
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return moment.timestamp()
    except ValueError:
        raise ValueError(f"{_show(text)} is not an RFC 3339 time (e.g. 2025-01-31T12:00:00Z) or a date") from None
