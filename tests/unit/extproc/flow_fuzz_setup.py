"""The fuzzed gateway: its config, a fake Redis, and the messages Envoy sends (built by tests/support)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from redis.exceptions import ConnectionError as RedisConnectionError

from modeldock.config import hash_key
from modeldock.gateway import Gateway
from tests.support.extproc_messages import ATTR, body_request, headers_request, raw_headers, struct, with_attributes
from tests.support.extproc_messages import make_gateway as support_gateway

KEY, FREE_KEY = "k-fuzz-acme", "k-fuzz-free"
TENANT_OF = {KEY: "acme", FREE_KEY: "free"}
TENANTS = ("acme", "free")
ENDPOINTS = {"llama-8b": ["10.0.0.1:8000", "10.0.0.2:8000"], "llama-70b": ["10.0.0.3:8000"]}
CONFIG: dict[str, Any] = {
    "tenants": [
        {"id": "acme", "api_key_hashes": [hash_key(KEY)], "models": ["llama-*"], "requests_per_minute": 3,
         "requests_per_minute_per_model": {"llama-8b": 2}, "max_in_flight": 1},
        {"id": "free", "api_key_hashes": [hash_key(FREE_KEY)], "models": ["*"]},
    ],
    "models": [
        {"name": "llama-8b", "endpoints": ENDPOINTS["llama-8b"]},
        {"name": "llama-70b", "served_name": "meta/llama-70b", "endpoints": ENDPOINTS["llama-70b"]},
        {"name": "mistral", "endpoints": ["10.0.0.4:8000"]},  # never announced: no endpoint to pick
    ],
    "limits": {"max_body_bytes": 2048},
}
LIMIT = CONFIG["limits"]["max_body_bytes"]
VISIBLE = {"acme": ["llama-8b", "llama-70b"], "free": ["llama-8b", "llama-70b", "mistral"]}
REDIS_MODES = ["none", "up", "down-closed", "down-open", "garbage"]
STATUSES = {200, 400, 401, 403, 404, 413, 429, 503}
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
               404: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "server_error"}
COMPLETIONS = ("/v1/chat/completions", "/v1/completions")
RATELIMIT_HEADERS = {"x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"}
DURATION = re.compile(r"\d+ms|(\d+h)?(\d+m)?\d+(\.\d+)?s")  # Go-style, as OpenAI's reset header
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
seeds = st.integers(0, 255)  # for the picker's random tie-breaks


class FakeRedis:
    """Stands in for redis.asyncio.Redis: the script call admits, fails, or answers garbage."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.gate: asyncio.Event | None = None  # "hang": wait here until set (or cancelled)

    def register_script(self, _lua: str) -> Callable[..., Any]:
        async def call(keys: list[str], args: list[Any]) -> Any:
            if self.gate is not None:
                await self.gate.wait()
            if self.mode.startswith("down"):
                raise RedisConnectionError("Connection refused")
            if self.mode == "garbage":
                return [b"x"]
            window_us, limits = int(args[0]), [int(a) for a in args[2:]]
            return [1, *[v for limit in limits for v in (limit - 1, window_us, 0)]]

        return call

    async def aclose(self) -> None:
        pass


def make_gateway(mode: str = "none", redis: FakeRedis | None = None, seed: int = 0) -> Gateway:
    data = json.loads(json.dumps(CONFIG))
    if mode != "none":
        data["limits"].update(redis_url="redis://fuzz.invalid:6379/0", redis_fail_open=mode == "down-open")
    fake = redis or FakeRedis(mode)
    # A seeded tie-break: the same pick on every run of an example, so that a failure replays and shrinks.
    return support_gateway(data, ENDPOINTS, seed=seed, redis_client_factory=lambda _u, _t: fake)


# ---------------------------------------------------------------- messages (built by tests/support)


def body_msg(body: bytes, method: str | None = "POST", path: str | None = "/v1/completions",
             auth: str | None = f"Bearer {KEY}", request_id: str | None = "r-1",
             extra: dict[str, Any] | None = None) -> ep.ProcessingRequest:
    """The buffered request body with the request attributes Envoy sends beside it (None: absent)."""
    return body_request(body, method=method, path=path, request_id=request_id, authorization=auth, extra=extra)


def reply_msg(status: str, method: str = "POST", path: str = "/v1/completions") -> ep.ProcessingRequest:
    """Response headers as the old two-message design had them (Envoy's own reply to a bodiless request
    among them); with the response phase skipped, none may arrive first."""
    msg = headers_request(raw_headers((":status", status)), end_of_stream=False, field="response_headers")
    return with_attributes(msg, {ATTR: struct({"request.method": method, "request.path": path})})


def models_msg(*pairs: tuple[str, str]) -> ep.ProcessingRequest:
    return headers_request(raw_headers(*pairs))

# ---------------------------------------------------------------- invalid UTF-8 on the wire


def corrupt(msg: ep.ProcessingRequest, junk: dict[tuple[str, str], bytes]) -> bytes:
    """`msg` serialized, with the string attribute (namespace, name) -> bytes of `junk` (not UTF-8) in place.

    Each value is serialized as a same-length ASCII marker, then the marker's bytes are replaced, so every
    length prefix stays right."""
    copy = ep.ProcessingRequest()
    copy.CopyFrom(msg)
    markers = {}
    for i, ((ns, name), value) in enumerate(sorted(junk.items())):
        assert len(value) >= 4
        marker = f"\x01{i:02d}".ljust(len(value), "\x02")
        copy.attributes[ns].fields[name].string_value = marker
        markers[marker.encode()] = value
    raw = copy.SerializeToString()
    for marker, value in markers.items():
        assert raw.count(marker) == 1
        raw = raw.replace(marker, value)
    return raw


def decoded(msg: ep.ProcessingRequest, junk: dict[tuple[str, str], bytes]) -> ep.ProcessingRequest:
    """What ext_proc should see of `corrupt(msg, junk)`: the bytes with replacement characters."""
    copy = ep.ProcessingRequest()
    copy.CopyFrom(msg)
    for (ns, name), value in junk.items():
        copy.attributes[ns].fields[name].string_value = value.decode("utf-8", "replace")
    return copy


# Bytes that are never valid UTF-8 at the start of a string, then anything.
not_utf8 = st.builds(lambda a, b: a + b, st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3(", b"\xed\xa0\x80", b"\x80",
                                                          b"\xc0\xaf"]),
                     st.binary(min_size=3, max_size=20))


@st.composite
def corruptions(draw: st.DrawFn, msg: ep.ProcessingRequest) -> dict[tuple[str, str], bytes]:
    """Some of the message's string attributes, each to become invalid UTF-8."""
    chosen = {}
    for ns in sorted(msg.attributes):
        for name, value in sorted(msg.attributes[ns].fields.items()):
            if value.WhichOneof("kind") == "string_value" and draw(st.integers(0, 2)) == 0:
                chosen[(ns, name)] = draw(not_utf8)
    return chosen


def all_strings(msg: ep.ProcessingRequest) -> bool:
    return all(v.WhichOneof("kind") == "string_value" for s in msg.attributes.values() for v in s.fields.values())
