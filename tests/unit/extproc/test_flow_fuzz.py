"""Fuzzing the ext_proc state machine with random ProcessingRequest messages.

Envoy's protocol (docs/envoy.md): a completion request arrives as one `request_body` message
carrying the request's method, path, id and Authorization header as attributes; only
`GET /v1/models` sends `request_headers`. Nothing else is ever sent (the response phases are
skipped, and Envoy answers a request without a body itself). When Envoy retries a routed request
onto another endpoint, its access log reports that out of band: `RequestFlow.retried_on(address)`,
or `ExtProcServicer.retried(request_id, address)` through the servicer.

Random phase kinds in random order, random headers (raw and string values, arbitrary bytes),
random bodies and random attributes (absent, non-string, arbitrary text, repeated Authorization
headers joined with ","), and plausible requests with at most one fault, sent to `RequestFlow`
directly (one flow, and several flows interleaved with early finishes) and through the real
grpc.aio servicer in process, where attribute strings may also be invalid UTF-8 on the wire;
retry reports (good, malformed and unknown addresses; known, unknown and repeated request ids)
come at any point, before routing and after the end too. Invariants:

- every answer is a ProcessingResponse of the kind asked or an immediate_response; the first
  message of a stream is either routed or answered with an immediate_response, and every later
  one gets an empty answer of its kind;
- no exception escapes (only a task cancellation may, and that holds nothing either);
- rejections are OpenAI-style JSON with a status that matches the error type; no header we set
  carries CR, LF or NUL; ext_proc never mutates request headers (Envoy strips them itself);
- a request is routed (dynamic metadata with the cluster, the model, the endpoints and, when its
  tenant has limits, the x-ratelimit-* values) only when it is a POST to a completion path with
  exactly one valid Bearer key that may use the model; the API keys appear in no answer unless the
  client also put them where answers echo (path, body);
- each live routed request is counted on exactly one endpoint: its primary, then wherever the last
  well-formed retry report put it; a report for anything else changes nothing;
- after `finish()` (or the end of the gRPC stream), every in-flight count and concurrency slot is 0.

The regression tests at the end pin inputs the fuzzer once found (see test_request_properties.py
for the parser side).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import json_format, message, struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import ConnectionError as RedisConnectionError

from modeldock.admission.limits import Admission
from modeldock.clock import FakeClock
from modeldock.config import hash_key, parse_config
from modeldock.types import Endpoint
from modeldock.extproc.flow import RequestFlow
from modeldock.extproc.gateway import Gateway
from modeldock.extproc.server import ExtProcServicer
from modeldock.extproc.wire import add_servicer, parse_request
from modeldock.picking import Picker

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
ATTR = "envoy.filters.http.ext_proc"
AUTH = "request.headers['authorization']"
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
    config = parse_config(data)
    clock = FakeClock()
    fake = redis or FakeRedis(mode)
    # A seeded tie-break: the same pick on every run of an example, so that a failure replays and shrinks.
    picker = Picker(clock, rng=random.Random(seed))
    gw = Gateway(config, clock, picker, Admission(config, clock, redis_client_factory=lambda _u, _t: fake))
    for model, endpoints in ENDPOINTS.items():
        gw.on_endpoints(model, tuple(Endpoint.parse(e) for e in endpoints))
    return gw


# ---------------------------------------------------------------- message builders


def _struct(values: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(values)
    return s


def _with_attrs(msg: ep.ProcessingRequest, attrs: dict[str, struct_pb2.Struct]) -> ep.ProcessingRequest:
    for name, value in attrs.items():
        msg.attributes[name].CopyFrom(value)
    return msg


def _headers_msg(field: str, headers: list[base_pb2.HeaderValue], eos: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(**{field: ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers),
                                                         end_of_stream=eos)})


def _raw_headers(*pairs: tuple[str, str]) -> list[base_pb2.HeaderValue]:
    return [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]


def body_msg(body: bytes, method: str | None = "POST", path: str | None = "/v1/completions",
             auth: str | None = f"Bearer {KEY}", request_id: str | None = "r-1",
             extra: dict[str, Any] | None = None) -> ep.ProcessingRequest:
    """The buffered request body with the request attributes Envoy sends beside it (None: absent)."""
    values = {name: value for name, value in
              [("request.method", method), ("request.path", path), ("request.id", request_id), (AUTH, auth)]
              if value is not None}
    values.update(extra or {})
    return _with_attrs(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)),
                       {ATTR: _struct(values)})


def reply_msg(status: str, method: str = "POST", path: str = "/v1/completions") -> ep.ProcessingRequest:
    """Response headers as the old two-message design had them (Envoy's own reply to a bodiless request
    among them); with the response phase skipped, none may arrive first."""
    msg = _headers_msg("response_headers", _raw_headers((":status", status)), False)
    return _with_attrs(msg, {ATTR: _struct({"request.method": method, "request.path": path})})


def models_msg(*pairs: tuple[str, str]) -> ep.ProcessingRequest:
    return _headers_msg("request_headers", _raw_headers(*pairs), True)


# ---------------------------------------------------------------- strategies


header_keys = st.one_of(
    st.sampled_from([":method", ":path", "authorization", "content-length", "x-request-id", ":status", ":authority",
                     "x-gateway-destination-endpoint", "x-modeldock-cluster", "content-type", "Authorization"]),
    st.text(max_size=12),
)
GOOD_AUTH = [f"Bearer {KEY}", f"Bearer {FREE_KEY}", f"bearer  {KEY}", f" Bearer {FREE_KEY} ", f"BEARER {KEY}"]
BAD_AUTH = ["Bearer ", "Bearer wrong", "Basic eDp5", "", " ", KEY, f"Bearer {KEY} x", f"Token {KEY}"]
auth_values = st.one_of(
    st.sampled_from(GOOD_AUTH + BAD_AUTH),
    # Envoy joins a repeated header's values with ","
    st.lists(st.sampled_from(GOOD_AUTH + BAD_AUTH), min_size=2, max_size=3).map(",".join),
    st.text(max_size=30),
)
methods = st.one_of(st.sampled_from(["POST", "GET", "PUT", "post", "HEAD", ""]), st.text(max_size=8))
paths = st.one_of(
    st.sampled_from([*COMPLETIONS, "/v1/completions?x=1", "/v1/models", "/v1/models?x=1", "/v1/embeddings", "/", "",
                     "v1/completions", "/v1/chat/completions/x", f"/v1/completions?key={KEY}"]),
    st.text(max_size=30),
)
# Where Envoy reports a retry went: the model's endpoints, others, spellings of the same one, and malformed ones.
addresses = st.one_of(
    st.sampled_from([*ENDPOINTS["llama-8b"], *ENDPOINTS["llama-8b"], *ENDPOINTS["llama-70b"], "10.0.0.9:8000",
                     "[::1]:8000", "[0:0::1]:8000", " 10.0.0.2:8000", "garbage", "", "10.0.0.1:0", "10.0.0.1:99999",
                     "10.0.0.1:²", "10.0.0.1"]),
    st.text(max_size=20),
)
text_values = st.one_of(
    st.sampled_from(["POST", "GET", "PUT", *COMPLETIONS, "/v1/models", "/v1/models?x=1", "/v1/embeddings",
                     *GOOD_AUTH, *BAD_AUTH, "0", "12", "2049", "99999999999", "200", "404", "413", "503", "abc",
                     "10.0.0.1:8000"]),
    st.text(max_size=30),
)
not_strings = st.one_of(st.floats(allow_nan=False), st.booleans(), st.none(),
                        st.lists(st.one_of(text_values, st.integers(-3, 3)), max_size=2),
                        st.dictionaries(st.sampled_from(["a", AUTH]), text_values, max_size=1))
# Strategies that composites draw from are built once, here: building one per draw (and validating it) was
# most of the data generation time, which is what makes a failure slow to shrink.
extra_attributes = st.dictionaries(st.text(max_size=8), st.one_of(text_values, not_strings), max_size=2)
header_how = st.sampled_from(["raw", "value", "bytes"])
attribute_how = st.sampled_from(["absent", "string", "string", "other"])
namespaces = st.lists(st.one_of(st.just(ATTR), st.just(ATTR), st.sampled_from(["envoy.lb", "modeldock"]),
                                st.text(max_size=10)), max_size=2)


@st.composite
def header_value(draw: st.DrawFn) -> base_pb2.HeaderValue:
    key = draw(header_keys)
    how = draw(header_how)
    if how == "bytes":
        raw = draw(st.binary(max_size=24))
        return base_pb2.HeaderValue(key=key, raw_value=raw)
    text = draw(text_values)
    if how == "raw":
        return base_pb2.HeaderValue(key=key, raw_value=text.encode())
    return base_pb2.HeaderValue(key=key, value=text)


ATTRIBUTE_FIELDS = {"request.method": methods, "request.path": paths, "request.id": st.text(max_size=12),
                    AUTH: auth_values}


@st.composite
def attribute_struct(draw: st.DrawFn) -> struct_pb2.Struct:
    """Envoy's attributes, each absent, a string, or (never from Envoy) some other JSON value."""
    values: dict[str, Any] = {}
    for name, strategy in ATTRIBUTE_FIELDS.items():
        how = draw(attribute_how)
        if how == "string":
            values[name] = draw(strategy)
        elif how == "other":
            values[name] = draw(not_strings)
    values.update(draw(extra_attributes))
    return _struct(values)


attribute_structs = attribute_struct()


@st.composite
def attributes(draw: st.DrawFn) -> dict[str, struct_pb2.Struct]:
    # Deduplicated here rather than by `unique=True`, whose retries make shrinking slow.
    return {name: draw(attribute_structs) for name in dict.fromkeys(draw(namespaces))}


payloads = st.fixed_dictionaries(
    {"model": st.one_of(st.sampled_from(["llama-8b", "llama-70b", "mistral", "nope", "llama-8b\r\nx: y", ""]),
                        st.integers(-5, 5), st.none())},
    optional={"messages": st.just([{"role": "user", "content": "hi"}]), "stream": st.booleans(),
              "pad": st.sampled_from(["x", "y" * 2100])},
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["json", "json", "json", "truncated", "bytes", "empty", "big", "array", "huge"]))
    if kind == "huge":  # numbers a double cannot hold: Python reads them as infinity
        model = draw(st.sampled_from(["llama-8b", "llama-70b"]))
        number = draw(st.sampled_from(["1e999", "-1e400", "1E+309", "0.5"]))
        return f'{{"model": "{model}", "temperature": {number}}}'.encode()
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "empty":
        return b""
    if kind == "big":
        return json.dumps({"model": "llama-8b", "pad": "z" * 3000}).encode()
    if kind == "array":
        return b'[{"model": "llama-8b"}]'
    raw = json.dumps(draw(payloads)).encode()
    if kind == "truncated":
        raw = raw[: draw(st.integers(0, max(len(raw) - 1, 0)))]
    return raw


random_message = st.one_of(
    st.builds(lambda h, e, a: _with_attrs(_headers_msg("request_headers", h, e), a),
              st.lists(header_value(), max_size=8), st.booleans(), attributes()),
    st.builds(lambda b, e, a: _with_attrs(ep.ProcessingRequest(request_body=ep.HttpBody(body=b, end_of_stream=e)), a),
              bodies(), st.booleans(), attributes()),
    st.builds(lambda h, a: _with_attrs(_headers_msg("response_headers", h, False), a),
              st.lists(header_value(), max_size=4), attributes()),
    st.builds(lambda b, e: ep.ProcessingRequest(response_body=ep.HttpBody(body=b, end_of_stream=e)),
              st.binary(max_size=32), st.booleans()),
    st.builds(lambda h: ep.ProcessingRequest(request_trailers=ep.HttpTrailers(trailers=base_pb2.HeaderMap(headers=h))),
              st.lists(header_value(), max_size=3)),
    st.builds(lambda h: ep.ProcessingRequest(response_trailers=ep.HttpTrailers(trailers=base_pb2.HeaderMap(headers=h))),
              st.lists(header_value(), max_size=3)),
    st.just(ep.ProcessingRequest()),  # no phase set at all
)


# What a request should get as the answer to its first message:
# ("routed", tenant, model) | ("models", tenant) | ("rejected", status, {codes}) | None (any).
Expected = tuple[Any, ...] | None


def _rejected(status: int, *codes: str) -> Expected:
    return ("rejected", status, set(codes))


AUTH_FAULTS: dict[str | None, str] = {
    None: "missing_api_key", "": "missing_api_key", " ": "missing_api_key", "Bearer ": "missing_api_key",
    "Bearer wrong": "invalid_api_key", f"Bearer {KEY} x": "invalid_api_key", f"Bearer {KEY}x": "invalid_api_key",
    "Basic eDp5": "invalid_authorization", KEY: "invalid_authorization", f"Token {KEY}": "invalid_authorization",
    # Repeated Authorization headers, as Envoy joins them.
    f"Bearer {KEY},Bearer {KEY}": "invalid_authorization", f"Bearer {KEY},Bearer {FREE_KEY}": "invalid_authorization",
    f"Bearer {KEY},": "invalid_authorization", f",Bearer {KEY}": "invalid_authorization",
}
MODEL_FAULTS: dict[str, tuple[Any, dict[str, Expected]]] = {
    "nope": ("nope", {t: _rejected(404, "model_not_found") for t in TENANTS}),
    "glob": ("llama-*", {t: _rejected(404, "model_not_found") for t in TENANTS}),
    "empty": ("", {t: _rejected(400, "invalid_model") for t in TENANTS}),
    "crlf": ("llama-8b\r\nx: y", {t: _rejected(400, "invalid_model") for t in TENANTS}),
    "long": ("m" * 257, {t: _rejected(400, "invalid_model") for t in TENANTS}),
    "int": (7, {t: _rejected(400, "invalid_model") for t in TENANTS}),
    "list": (["llama-8b"], {t: _rejected(400, "invalid_model") for t in TENANTS}),
    "null": (None, {t: _rejected(400, "missing_model") for t in TENANTS}),
    # acme may not use it; free may, but no endpoint was ever announced for it.
    "mistral": ("mistral", {"acme": _rejected(403, "model_not_allowed"),
                            "free": _rejected(503, "no_ready_endpoints")}),
}


def _padded(model: str, size: int) -> bytes:
    base = json.dumps({"model": model, "pad": ""}, separators=(",", ":")).encode()
    raw = json.dumps({"model": model, "pad": "p" * (size - len(base))}, separators=(",", ":")).encode()
    assert len(raw) == size
    return raw


plausible_ids = st.one_of(st.none(), st.just("r-2"), st.text(max_size=10))


@st.composite
def plausible_request(draw: st.DrawFn) -> tuple[list[ep.ProcessingRequest], Expected]:
    """A good request as Envoy sends it, with at most one thing wrong, and the answer it should get."""
    fault = draw(st.sampled_from(["none", "none", "method", "path", "auth", "model", "body", "limit", "models",
                                  "reply_first", "headers_first", "stray"]))
    key = draw(st.sampled_from([KEY, FREE_KEY]))
    tenant = TENANT_OF[key]
    method = "POST"
    path = draw(st.sampled_from([*COMPLETIONS, "/v1/completions?x=1"]))
    auth: str | None = draw(st.sampled_from([f"Bearer {key}", f"bearer  {key}", f" Bearer {key} ", f"BEARER {key}"]))
    model: Any = draw(st.sampled_from(["llama-8b", "llama-70b"]))
    request_id = draw(plausible_ids)
    extra = draw(extra_attributes)
    body: bytes | None = None
    expected: Expected = ("routed", tenant, model)
    if fault == "method":
        method = draw(st.sampled_from(["GET", "PUT", "", "post", "HEAD"]))
        expected = _rejected(400, "method_not_allowed")
    elif fault == "path":
        path = draw(st.sampled_from(["/v1/embeddings", "/", "", "/v1/chat/completions/x", "v1/completions",
                                     "/v1/models", "/V1/completions"]))
        expected = _rejected(404, "unknown_url")
    elif fault == "auth":
        auth = draw(st.sampled_from(list(AUTH_FAULTS)))
        expected = _rejected(401, AUTH_FAULTS[auth])
    elif fault == "model":
        model, outcomes = MODEL_FAULTS[draw(st.sampled_from(sorted(MODEL_FAULTS)))]
        expected = outcomes[tenant]
    elif fault == "body":
        body = draw(bodies())
        expected = None
    elif fault == "limit":
        over = draw(st.booleans())
        body = _padded(model, LIMIT + 1 if over else LIMIT)
        if over:
            expected = _rejected(413, "request_too_large")
    elif fault == "models":
        models_path = draw(st.sampled_from(["/v1/models", "/v1/models?limit=1"]))
        broken = draw(st.sampled_from(["none", "none", "method", "auth"]))
        pairs = [(":method", "GET"), (":path", models_path), ("x-request-id", "r-3")]
        if broken == "method":
            pairs[0] = (":method", draw(st.sampled_from(["POST", "PUT", "get"])))
            expected = _rejected(400, "method_not_allowed")
        if broken == "auth":
            bad = draw(st.sampled_from([a for a in AUTH_FAULTS if a is None or "," not in a]))
            if bad is not None:
                pairs.append(("authorization", bad))
            expected = _rejected(401, AUTH_FAULTS[bad])
        else:
            pairs.append(("authorization", f"Bearer {key}"))
            if broken == "none":
                expected = ("models", tenant)
        headers = _raw_headers(*pairs) + draw(st.lists(header_value().filter(
            lambda h: h.key not in (":method", ":path", "authorization")), max_size=2))
        return [_headers_msg("request_headers", headers, True)], expected
    elif fault == "reply_first":
        # Response headers first, such as Envoy's own 404 or 413 used to be: never ext_proc's to answer now.
        status = draw(st.sampled_from(["404", "413", "200", "503", "", "4²4"]))
        method = draw(st.sampled_from(["POST", "GET"]))
        return [reply_msg(status, method, path), body_msg(json.dumps({"model": model}).encode(), path=path, auth=auth)], \
            _rejected(400, "invalid_request")
    elif fault == "headers_first":
        # A completion route never sends its headers; if it did, nothing may go upstream from them.
        msg = _headers_msg("request_headers", _raw_headers((":method", "POST"), (":path", path),
                                                           ("authorization", f"Bearer {key}")), False)
        return [msg, body_msg(json.dumps({"model": model}).encode(), path=path, auth=auth)], \
            _rejected(400, "invalid_request")
    elif fault == "stray":
        first = draw(st.sampled_from([
            ep.ProcessingRequest(request_trailers=ep.HttpTrailers()),
            ep.ProcessingRequest(response_trailers=ep.HttpTrailers()),
            ep.ProcessingRequest(response_body=ep.HttpBody(body=b"x", end_of_stream=True)),
            ep.ProcessingRequest(),
        ]))
        return [first, body_msg(json.dumps({"model": model}).encode(), path=path, auth=auth)], \
            _rejected(400, "invalid_request")
    if body is None:
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    return [body_msg(body, method, path, auth, request_id, extra)], expected


plausible_messages = plausible_request().map(lambda case: case[0])


@st.composite
def good_request(draw: st.DrawFn) -> list[ep.ProcessingRequest]:
    """What Envoy sends for a good completion request: its one message. The ids repeat on purpose: a client
    may send its own x-request-id, so two live requests can share one."""
    key = draw(st.sampled_from([KEY, FREE_KEY]))
    model = draw(st.sampled_from(["llama-8b", "llama-70b"]))
    path = draw(st.sampled_from(COMPLETIONS))
    request_id = draw(st.sampled_from(["r-1", "r-2", ""]))
    return [body_msg(json.dumps({"model": model, "prompt": "x"}).encode(), path=path, auth=f"Bearer {key}",
                     request_id=request_id)]


requests_then_anything = (
    st.builds(lambda p, g: p + g, good_request(), st.lists(random_message, max_size=5)),
    st.builds(lambda p, g: p + g, plausible_messages, st.lists(random_message, max_size=4)),
)
sequences = st.one_of(st.lists(random_message, max_size=8), *requests_then_anything)


# ---------------------------------------------------------------- invariants


def _attrs(msg: ep.ProcessingRequest) -> dict[str, str]:
    """The string attributes Envoy sent under ext_proc's namespace."""
    if ATTR not in msg.attributes:
        return {}
    return {k: v.string_value for k, v in msg.attributes[ATTR].fields.items() if v.WhichOneof("kind") == "string_value"}


def _header_pairs(msg: ep.ProcessingRequest) -> list[tuple[str, bytes]]:
    return [(h.key, h.raw_value or h.value.encode()) for h in msg.request_headers.headers.headers]


def keys_only_in_authorization(messages: list[ep.ProcessingRequest]) -> bool:
    """True unless a key also appears where an answer may echo it back to the same client: the path
    (attribute or header) or the body (error messages name the path and the model; an alias rewrite
    sends the body back)."""
    for msg in messages:
        echoable = [msg.request_body.body, _attrs(msg).get("request.path", "").encode()]
        echoable += [value for key, value in _header_pairs(msg) if key == ":path"]
        if any(k.encode() in part for k in (KEY, FREE_KEY) for part in echoable):
            return False
    return True


def _mutation_ok(mutation: ep.HeaderMutation) -> None:
    for option in mutation.set_headers:
        key, raw = option.header.key, option.header.raw_value or option.header.value.encode()
        assert key == key.lower() and key != "authorization", key
        assert not any(c in raw for c in b"\r\n\x00"), (key, raw)


def _changes_nothing(msg: message.Message) -> bool:
    """Every field set is a message that sets nothing in turn (an empty CommonResponse is still a field)."""
    return all(isinstance(value, message.Message) and _changes_nothing(value) for _, value in msg.ListFields())


def _tenant_of(authorization: str) -> str | None:
    """The tenant whose key is the one Bearer credential in this (possibly joined) Authorization value."""
    parts = authorization.split(",")
    if len(parts) != 1:
        return None
    scheme, _, key = parts[0].strip().partition(" ")
    return TENANT_OF.get(key.strip()) if scheme.lower() == "bearer" else None


def _no_constant(name: str) -> Any:
    raise AssertionError(f"{name} is not JSON")


def _strict_json(raw: bytes) -> Any:
    """The JSON value of `raw`, which must be standard JSON (no NaN or Infinity)."""
    return json.loads(raw, parse_constant=_no_constant)


def check_routed(request: ep.ProcessingRequest, resp: ep.ProcessingResponse) -> str:
    """The request goes upstream: only an authenticated POST to a completion path, with a model its key may use;
    the cluster, model, rate-limit values and endpoint list are dynamic metadata, and no request header is
    changed. Returns the model."""
    common = resp.request_body.response
    assert common.clear_route_cache, "the route must be picked again, with the metadata"
    assert common.HasField("header_mutation"), "clear_route_cache is ignored without a header mutation"
    assert not common.header_mutation.set_headers and not common.header_mutation.remove_headers
    assert common.status == ep.CommonResponse.CONTINUE and not common.HasField("trailers")
    assert not resp.HasField("mode_override")
    attrs = _attrs(request)
    assert attrs.get("request.method") == "POST", attrs
    assert attrs.get("request.path", "").split("?", 1)[0] in COMPLETIONS, attrs
    tenant = _tenant_of(attrs.get(AUTH, ""))
    assert tenant is not None, f"routed without a valid key: {attrs.get(AUTH)!r}"
    assert len(request.request_body.body) <= LIMIT
    data = json.loads(request.request_body.body)
    model = data["model"]
    assert model in VISIBLE[tenant] and model in ENDPOINTS, (tenant, model)
    meta = json_format.MessageToDict(resp.dynamic_metadata)
    assert set(meta) == {"modeldock", "envoy.lb"}, meta
    assert set(meta["envoy.lb"]) == {"x-gateway-destination-endpoint"}, meta
    endpoints = meta["envoy.lb"]["x-gateway-destination-endpoint"].split(",")
    assert endpoints and len(set(endpoints)) == len(endpoints) and set(endpoints) <= set(ENDPOINTS[model]), endpoints
    route = dict(meta["modeldock"])
    # The model names it in Envoy's own error replies; the route adds the x-ratelimit-* values to the response.
    assert route.pop("cluster") == f"model:{model}" and route.pop("model") == model, route
    limits = {k: route.pop(k) for k in RATELIMIT_HEADERS & set(route)}
    if tenant == "acme":  # the only tenant with request windows
        assert set(limits) == RATELIMIT_HEADERS, limits
        assert limits["x-ratelimit-limit-requests"] in ("2", "3"), limits
        assert limits["x-ratelimit-remaining-requests"].isdigit(), limits
        assert int(limits["x-ratelimit-remaining-requests"]) < int(limits["x-ratelimit-limit-requests"]), limits
        assert DURATION.fullmatch(limits["x-ratelimit-reset-requests"]), limits
    else:
        assert not limits, limits
    if model == "llama-70b":  # an alias: the body names the served model, and Envoy fixes content-length
        rewritten = common.body_mutation.body
        assert _strict_json(rewritten) == {**data, "model": "meta/llama-70b"}
        assert route == {"content_length": str(len(rewritten))}, route
    else:
        assert not common.HasField("body_mutation")
        assert not route, route
    return model


def primary_of(resp: ep.ProcessingResponse) -> Endpoint:
    """The endpoint a routed request is counted on first: the head of its override_host list."""
    endpoints = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    return Endpoint.parse(endpoints.string_value.split(",")[0])


def check_immediate(request: ep.ProcessingRequest, imm: ep.ImmediateResponse) -> None:
    assert imm.status.code in STATUSES, imm.status.code
    assert imm.details == f"modeldock_{imm.status.code}"
    _mutation_ok(imm.headers)
    assert not imm.headers.remove_headers
    headers = {h.header.key: h.header.raw_value for h in imm.headers.set_headers}
    assert headers["content-type"] == b"application/json"
    payload = json.loads(imm.body)
    asked = request.WhichOneof("request")
    if imm.status.code == 200:
        # Only the model list is answered 200, and only for a known key.
        assert asked == "request_headers"
        pairs = _header_pairs(request)
        assert dict(pairs).get(":method") == b"GET"
        assert dict(pairs)[":path"].split(b"?")[0] == b"/v1/models"
        auths = [v.decode("utf-8", "surrogateescape") for k, v in pairs if k == "authorization"]
        assert len(auths) == 1 and (tenant := _tenant_of(auths[0])) is not None, auths
        assert payload["object"] == "list"
        assert [m["id"] for m in payload["data"]] == VISIBLE[tenant]
        assert all(m["object"] == "model" and m["owned_by"] == "modeldock" for m in payload["data"])
        return
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and err["code"] and err["param"] is None, err
    assert err["type"] == ERROR_TYPES[imm.status.code], (imm.status.code, err)
    if imm.status.code == 429:
        assert headers["retry-after"].isdigit()
    if asked == "request_headers":
        # Only the route is checked, then the key of a /v1/models request: no body, no model, no admission.
        assert imm.status.code in (400, 401, 404), (imm.status.code, err)
        assert imm.status.code != 404 or err["code"] == "unknown_url", err
        assert imm.status.code != 400 or err["code"] in ("method_not_allowed", "invalid_request"), err
    elif asked != "request_body":
        # Nothing but a body (or the model list's headers) may come first, Envoy's own replies included.
        assert (imm.status.code, err["code"]) == (400, "invalid_request"), err


def check_response(request: ep.ProcessingRequest, resp: ep.ProcessingResponse, first: bool,
                   secret: bool = True) -> str:
    """Assert the answer is well formed for the message; returns its kind. `first`: the stream's first message.
    `secret`: the keys were sent only where answers never echo them, so no answer may contain them."""
    assert isinstance(resp, ep.ProcessingResponse)
    raw = resp.SerializeToString()
    assert ep.ProcessingResponse.FromString(raw) == resp
    if secret:
        assert KEY.encode() not in raw and FREE_KEY.encode() not in raw, resp
    kind = resp.WhichOneof("response")
    asked = request.WhichOneof("request")
    assert kind in {asked or "request_headers", "immediate_response"}, f"{asked} answered with {kind}"
    if kind == "immediate_response":
        # Envoy stops at an immediate response, and after the first answer the request is Envoy's.
        assert first, "an immediate response after the first message"
        check_immediate(request, resp.immediate_response)
        return kind
    if first and kind == "request_body":
        check_routed(request, resp)
        return kind
    # A first message is routed or answered; after that the request is Envoy's, and ext_proc changes nothing.
    assert not first, f"a first {asked} answered with {kind}"
    assert [f.name for f, _ in resp.ListFields()] == [kind] and _changes_nothing(getattr(resp, kind)), resp
    return kind


def check_expected(expected: Expected, resp: ep.ProcessingResponse, mode: str) -> None:
    """The first answer of a plausible request is the one its fault calls for."""
    if expected is None:
        return
    if expected[0] == "routed" and expected[1] == "acme" and mode in ("down-closed", "garbage"):
        expected = _rejected(503, "rate_limiter_unavailable")  # acme has windows, so Redis is asked
    kind = resp.WhichOneof("response")
    if expected[0] == "routed":
        assert kind == "request_body", resp
        assert json_format.MessageToDict(resp.dynamic_metadata)["modeldock"]["cluster"] == f"model:{expected[2]}"
    elif expected[0] == "models":
        assert kind == "immediate_response" and resp.immediate_response.status.code == 200, resp
        assert [m["id"] for m in json.loads(resp.immediate_response.body)["data"]] == VISIBLE[expected[1]]
    else:
        _, status, codes = expected
        assert kind == "immediate_response", resp
        assert resp.immediate_response.status.code == status, resp
        assert json.loads(resp.immediate_response.body)["error"]["code"] in codes, resp


def check_outcome(flow: RequestFlow, first: ep.ProcessingResponse | None) -> None:
    """The flow's outcome is what its first answer was; later messages and the end do not change it."""
    if first is None:
        assert (flow.outcome, flow.status) == ("incomplete", 0)
    elif first.WhichOneof("response") == "request_body":
        assert (flow.outcome, flow.status) == ("proxied", 0)  # the upstream's status is not ext_proc's to see
    else:
        code = first.immediate_response.status.code
        assert (flow.outcome, flow.status) == ("models" if code == 200 else "rejected", code)


@dataclass
class Counted:
    """Where a live routed request must be counted: its primary until Envoy reports a retry elsewhere."""

    primary: Endpoint
    at: Endpoint


def _moved(at: Endpoint, address: str, model: str | None) -> Endpoint:
    """Where a request counted `at` is after a retry report naming `address` (a malformed one, or one
    that is not an endpoint of the request's model, is ignored)."""
    try:
        target = Endpoint.parse(address)
    except ValueError:
        return at
    return target if target in {Endpoint.parse(e) for e in ENDPOINTS.get(model or "", ())} else at


def _model_serving(primary: Endpoint) -> str | None:
    """The model whose endpoint a request was routed to (no endpoint serves two models here)."""
    return next((m for m, eps in ENDPOINTS.items() if primary.address in eps), None)


def report_retry(flow: RequestFlow, address: str, counted: dict[Hashable, Counted], key: Hashable) -> None:
    """Envoy reports a retry of `flow` (`counted[key]` while it is live and routed) onto `address`."""
    retried = flow.retried
    flow.retried_on(address)
    if key not in counted:
        assert flow.retried == retried  # not routed, or ended: nothing moves
        return
    where = counted[key]
    where.at = _moved(where.at, address, flow.model)
    assert flow.lease is not None and flow.lease.endpoint == where.at, (address, flow.lease)
    assert flow.retried or where.at == where.primary
    try:
        canonical: bool | None = Endpoint.parse(address).address == address
    except ValueError:
        canonical = None
    if canonical is None:
        assert flow.retried == retried  # a malformed report changes nothing at all
    elif canonical:
        # Envoy's reports spell addresses as the picker does (attempts.py); another spelling of the
        # primary may read as a retry.
        assert flow.retried == (where.at != where.primary), (address, flow.served_by)


def _add_retry_targets(gw: Gateway, model: str, *addresses: str) -> None:
    """Give `model` more endpoints after a pick, so that retry reports naming them are the model's own."""
    gw.on_endpoints(model, tuple(Endpoint.parse(e) for e in [*ENDPOINTS[model], *addresses]))


def assert_counts(gw: Gateway, counted: dict[Hashable, Counted]) -> None:
    """The picker counts each live routed request once, where it was last reported, and nothing else."""
    want = Counter(where.at for where in counted.values())
    assert gw.picker.total_in_flight() == len(counted)
    for endpoint, n in want.items():
        assert gw.picker.in_flight(endpoint) == n, (endpoint, counted)


def live(flows: list[RequestFlow]) -> tuple[int, int]:
    """(leases, acme tickets) the flows still hold, by their own accounting."""
    leases = sum(1 for f in flows if f.lease is not None and not f.lease.released)
    tickets = sum(1 for f in flows if f.ticket is not None and not f.ticket.released and f.tenant is not None
                  and f.tenant.id == "acme")
    return leases, tickets


def assert_nothing_held(gw: Gateway) -> None:
    assert gw.picker.total_in_flight() == 0
    for tenant in TENANTS:
        assert gw.admission.in_flight(tenant) == 0


# ---------------------------------------------------------------- RequestFlow directly


# Envoy's retry reports between two steps (out of band: they may come at any time).
reports = st.lists(addresses, max_size=2)


@FUZZ
@given(mode=st.sampled_from(REDIS_MODES), seed=seeds, messages=sequences, data=st.data())
def test_one_flow_any_messages(mode: str, seed: int, messages: list[ep.ProcessingRequest],
                               data: st.DataObject) -> None:
    async def run() -> None:
        gw = make_gateway(mode, seed=seed)
        flow = RequestFlow(gw)
        secret = keys_only_in_authorization(messages)
        counted: dict[Hashable, Counted] = {}
        first: ep.ProcessingResponse | None = None
        for i, msg in enumerate(messages):
            for address in data.draw(reports):  # before routing too: ignored then
                report_retry(flow, address, counted, 0)
                assert_counts(gw, counted)
            resp = await flow.handle(msg)
            kind = check_response(msg, resp, first=i == 0, secret=secret)
            if i == 0:
                first = resp
                if kind == "request_body":
                    counted[0] = Counted(primary_of(resp), primary_of(resp))
            # Only a routed request holds a lease; it also holds a ticket. (An admitted request the picker then
            # rejects, e.g. no endpoints, keeps its ticket until the stream ends.)
            assert (flow.lease is not None) == bool(counted)
            assert flow.ticket is not None or not counted
            assert_counts(gw, counted)
            held = flow.ticket is not None and flow.tenant is not None and flow.tenant.id == "acme"
            assert gw.admission.in_flight("acme") == (1 if held else 0)
        check_outcome(flow, first)
        flow.finish()
        assert_nothing_held(gw)
        counted.clear()
        for address in data.draw(reports):  # the stream ended: a late report moves nothing
            report_retry(flow, address, counted, 0)
            assert_nothing_held(gw)
        flow.finish()  # idempotent
        assert_nothing_held(gw)
        check_outcome(flow, first)
        await gw.admission.close()

    asyncio.run(run())


@FUZZ
@given(mode=st.sampled_from(REDIS_MODES), seed=seeds, case=plausible_request(),
       tail=st.lists(random_message, max_size=3), retries=st.lists(addresses, max_size=3), stray=addresses)
def test_plausible_request_gets_its_answer(mode: str, seed: int, case: tuple[list[ep.ProcessingRequest], Expected],
                                           tail: list[ep.ProcessingRequest], retries: list[str], stray: str) -> None:
    """A request with one fault gets exactly the rejection for that fault; a good one is routed with its tenant's
    rate-limit values, counted on its primary, and moved wherever Envoy reports a retry went."""
    messages, expected = case
    messages = messages + tail

    async def run() -> None:
        gw = make_gateway(mode, seed=seed)
        flow = RequestFlow(gw)
        secret = keys_only_in_authorization(messages)
        flow.retried_on(stray)  # nothing routed yet: nothing to move
        assert not flow.retried and gw.picker.total_in_flight() == 0
        first = await flow.handle(messages[0])
        check_response(messages[0], first, first=True, secret=secret)
        check_expected(expected, first, mode)
        counted: dict[Hashable, Counted] = {}
        if first.WhichOneof("response") == "request_body":
            assert flow.lease is not None and flow.ticket is not None
            counted[0] = Counted(primary_of(first), primary_of(first))
            assert gw.picker.in_flight(counted[0].primary) == gw.picker.total_in_flight() == 1
            assert gw.admission.in_flight(flow.tenant.id) == 1
            route = first.dynamic_metadata.fields["modeldock"].struct_value.fields
            if flow.tenant.id == "acme":  # a fresh gateway: the first request of the tightest window
                limit = 2 if flow.model == "llama-8b" else 3
                assert route["x-ratelimit-limit-requests"].string_value == str(limit)
                assert route["x-ratelimit-remaining-requests"].string_value == str(limit - 1)
            for address in retries:
                report_retry(flow, address, counted, 0)
                assert_counts(gw, counted)
                assert gw.admission.in_flight(flow.tenant.id) == 1
        else:
            assert gw.picker.total_in_flight() == 0 and flow.lease is None
        for msg in messages[1:]:
            check_response(msg, await flow.handle(msg), first=False, secret=secret)
            assert_counts(gw, counted)
        check_outcome(flow, first)
        flow.finish()
        assert_nothing_held(gw)
        flow.retried_on(stray)  # after the end
        assert_nothing_held(gw)
        check_outcome(flow, first)
        await gw.admission.close()

    asyncio.run(run())


@FUZZ
@given(mode=st.sampled_from(REDIS_MODES), seed=seeds,
       scripts=st.lists(st.one_of(sequences, plausible_messages, good_request()), min_size=2, max_size=6),
       data=st.data())
def test_interleaved_flows_with_early_finishes(mode: str, seed: int, scripts: list[list[ep.ProcessingRequest]],
                                               data: st.DataObject) -> None:
    """Several requests at once, their messages interleaved at random; a flow may end at any point
    (client gone), and retry reports come for any flow at any time. The gateway's counts always match
    what the flows hold, each where it was last reported."""
    # One step per message plus one to end the stream, in a random interleaving.
    steps = data.draw(st.permutations([i for i, script in enumerate(scripts) for _ in range(len(script) + 1)]))

    async def run() -> None:
        gw = make_gateway(mode, seed=seed)
        flows = [RequestFlow(gw) for _ in scripts]
        secret = [keys_only_in_authorization(script) for script in scripts]
        firsts: list[ep.ProcessingResponse | None] = [None] * len(scripts)
        counted: dict[Hashable, Counted] = {}
        sent = [0] * len(scripts)
        ended = [False] * len(scripts)
        for i in steps:
            for address in data.draw(reports):  # for any flow: live, ended, or never routed
                j = data.draw(st.integers(0, len(flows) - 1))
                report_retry(flows[j], address, counted, j)
            if ended[i]:
                continue
            if sent[i] == len(scripts[i]) or data.draw(st.integers(0, 9)) == 0:  # sometimes the client leaves early
                flows[i].finish()
                ended[i] = True
                counted.pop(i, None)
            else:
                msg = scripts[i][sent[i]]
                resp = await flows[i].handle(msg)
                kind = check_response(msg, resp, first=sent[i] == 0, secret=secret[i])
                if sent[i] == 0:
                    firsts[i] = resp
                    if kind == "request_body":
                        counted[i] = Counted(primary_of(resp), primary_of(resp))
                sent[i] += 1
            leases, tickets = live(flows)
            assert len(counted) == leases
            assert_counts(gw, counted)
            assert gw.admission.in_flight("acme") == tickets <= 1  # max_in_flight
        assert all(ended)
        assert_nothing_held(gw)
        for flow, first in zip(flows, firsts, strict=True):
            check_outcome(flow, first)
        await gw.admission.close()

    asyncio.run(run())


async def test_cancelled_while_waiting_for_redis_holds_nothing() -> None:
    redis = FakeRedis("up")
    redis.gate = asyncio.Event()
    gw = make_gateway("up", redis)
    flow = RequestFlow(gw)
    task = asyncio.create_task(flow.handle(body_msg(b'{"model": "llama-8b"}')))
    await _until(lambda: gw.admission.in_flight("acme") == 1)  # the slot is taken while Redis is asked
    assert not task.done() and gw.picker.total_in_flight() == 0  # nothing picked before admission
    task.cancel()  # Envoy's stream ended: the client left
    with pytest.raises(asyncio.CancelledError):
        await task
    flow.finish()
    assert_nothing_held(gw)


# ---------------------------------------------------------------- invalid UTF-8 on the wire


def _corrupt(msg: ep.ProcessingRequest, junk: dict[tuple[str, str], bytes]) -> bytes:
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


def _decoded(msg: ep.ProcessingRequest, junk: dict[tuple[str, str], bytes]) -> ep.ProcessingRequest:
    """What ext_proc should see of `_corrupt(msg, junk)`: the bytes with replacement characters."""
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


def _all_strings(msg: ep.ProcessingRequest) -> bool:
    return all(v.WhichOneof("kind") == "string_value" for s in msg.attributes.values() for v in s.fields.values())


@FUZZ
@given(data=st.data(), msg=st.one_of(random_message, plausible_messages.map(lambda m: m[0])))
def test_parse_request_reads_invalid_utf8_attributes(data: st.DataObject, msg: ep.ProcessingRequest) -> None:
    """upb rejects a ProcessingRequest whose attribute string is not UTF-8; `parse_request` reads it, with
    replacement characters in those strings and everything else as sent."""
    raw = msg.SerializeToString()
    assert parse_request(raw) == msg
    junk = data.draw(corruptions(msg))
    if not junk:
        return
    raw = _corrupt(msg, junk)
    with pytest.raises(message.DecodeError):
        ep.ProcessingRequest.FromString(raw)
    got = parse_request(raw)
    want = _decoded(msg, junk)
    rest_got, rest_want = ep.ProcessingRequest(), ep.ProcessingRequest()
    rest_got.CopyFrom(got)
    rest_want.CopyFrom(want)
    rest_got.ClearField("attributes")
    rest_want.ClearField("attributes")
    assert rest_got == rest_want  # everything but the attributes, as sent
    assert set(got.attributes) == set(want.attributes)
    for ns, struct in want.attributes.items():
        assert set(got.attributes[ns].fields) == set(struct.fields)
        for name, value in struct.fields.items():
            if value.WhichOneof("kind") == "string_value":
                assert got.attributes[ns].fields[name].string_value == value.string_value, (ns, name)
    if _all_strings(msg):
        assert got == want


# ---------------------------------------------------------------- through the real grpc.aio servicer


PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


class _Failures(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            self.records.append(record)


async def _serve(gw: Gateway, on_retry: Callable[[RequestFlow], None] | None = None,
                 ) -> tuple[grpc.aio.Server, ExtProcServicer, int, list[RequestFlow]]:
    finished: list[RequestFlow] = []
    servicer = ExtProcServicer(gw, lambda flow, _s: finished.append(flow), on_retry)
    server = grpc.aio.server()
    add_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, servicer, port, finished


def _raw_process(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamMultiCallable:
    """Process, sending bytes as they are: lets a test put invalid UTF-8 on the wire."""
    return channel.stream_stream(PROCESS, request_serializer=lambda b: b,
                                 response_deserializer=ep.ProcessingResponse.FromString)


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


# Never empty (a stream opens with its first message). Good requests alone often: streams routed at once,
# some under the same id.
stream_messages = st.one_of(st.lists(random_message, min_size=1, max_size=8), *requests_then_anything,
                            good_request(), good_request())


@st.composite
def wire_script(draw: st.DrawFn) -> list[tuple[bytes, ep.ProcessingRequest]]:
    """A message sequence as bytes on the wire (some attribute strings made invalid UTF-8), each with what
    ext_proc should read from it."""
    out = []
    for msg in draw(stream_messages):
        junk = draw(corruptions(msg)) if draw(st.booleans()) else {}
        if junk and _all_strings(msg):
            out.append((_corrupt(msg, junk), _decoded(msg, junk)))
        elif junk:
            raw = _corrupt(msg, junk)
            out.append((raw, parse_request(raw)))  # non-string attributes: checked by the test above
        else:
            out.append((msg.SerializeToString(), msg))
    return out


def _request_id(msg: ep.ProcessingRequest) -> str:
    """The id ext_proc reads from a message: a missing or non-string attribute reads as none."""
    return _attrs(msg).get("request.id", "")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(REDIS_MODES), seed=seeds, scripts=st.lists(wire_script(), min_size=1, max_size=4),
       data=st.data())
def test_grpc_servicer_streams(mode: str, seed: int, scripts: list[list[tuple[bytes, ep.ProcessingRequest]]],
                               data: st.DataObject) -> None:
    """Streams through the real servicer, their steps interleaved at random, each ended by the client (done
    writing, or cancelled, early or not), with retry reports by request id in between. A report reaches the
    request routed last under its id while that request is live, and nothing else: not a request whose stream
    ended, nor one whose id a later request took; and one request's end never unregisters another's id."""
    # One step per message plus one to end the stream, in a random interleaving.
    steps = data.draw(st.permutations([i for i, script in enumerate(scripts) for _ in range(len(script) + 1)]))
    ids = sorted({_request_id(seen) for script in scripts for _, seen in script} | {"r-unknown"})
    failures = _Failures()
    logger = logging.getLogger("modeldock.extproc")
    logger.addHandler(failures)

    async def run() -> None:
        gw = make_gateway(mode, seed=seed)
        reached: list[RequestFlow] = []  # the flows retry reports moved, by the servicer's on_retry
        server, servicer, port, finished = await _serve(gw, reached.append)
        calls: list[grpc.aio.StreamStreamCall | None] = [None] * len(scripts)
        secret = [keys_only_in_authorization([seen for _, seen in script]) for script in scripts]
        firsts: list[ep.ProcessingResponse | None] = [None] * len(scripts)
        request_ids = [""] * len(scripts)
        registry: dict[str, int] = {}  # what the servicer should route reports by: id -> stream
        counted: dict[Hashable, Counted] = {}
        sent = [0] * len(scripts)
        answered = [False] * len(scripts)  # an immediate response: Envoy sends nothing more
        ended = [False] * len(scripts)

        def report(request_id: str, address: str) -> None:
            target = registry.get(request_id)
            reached.clear()
            servicer.retried(request_id, address)
            if target is None:
                assert not reached, f"a report for {request_id!r} reached {reached}"
                return
            before = counted[target].at
            counted[target].at = _moved(before, address, _model_serving(counted[target].primary))
            if counted[target].at == before:
                assert not reached, "on_retry for a report that moved nothing"  # counted once, as a real move
                return
            assert len(reached) == 1 and reached[0].head is not None and reached[0].head.request_id == request_id
            flow = reached[0]
            assert flow.lease is not None and not flow.lease.released and flow.lease.endpoint == counted[target].at

        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                process = _raw_process(channel)
                for i in steps:
                    for address in data.draw(reports):
                        report(data.draw(st.sampled_from(ids)), address)
                    assert_counts(gw, counted)
                    if ended[i]:
                        continue
                    call = calls[i]
                    # A stream ends after its last message, after an immediate response, or early (client gone);
                    # never before its first message, which is what opens it at the server.
                    if call is not None and (sent[i] == len(scripts[i]) or answered[i]
                                             or data.draw(st.integers(0, 9)) == 0):
                        if data.draw(st.booleans()):
                            call.cancel()
                        else:
                            await call.done_writing()
                            assert await call.read() is grpc.aio.EOF
                            assert await call.code() == grpc.StatusCode.OK
                        ended[i] = True
                        # The servicer ends every flow when its stream ends, cancelled or not (in the same step
                        # as it counts the stream closed: waiting on the count fails fast if it does not).
                        await _until(lambda: servicer.open_streams == sum(c is not None for c in calls) - sum(ended))
                        assert len(finished) == sum(ended)
                        flow = finished[-1]
                        check_outcome(flow, firsts[i])
                        if i in counted:
                            assert flow.head is not None and flow.head.request_id == request_ids[i]
                            del counted[i]
                        if registry.get(request_ids[i]) == i:
                            del registry[request_ids[i]]
                    else:
                        if call is None:
                            call = calls[i] = process()
                        raw, seen = scripts[i][sent[i]]
                        await call.write(raw)
                        resp = await call.read()
                        assert resp is not grpc.aio.EOF, f"the server ended the stream instead of answering: " \
                            f"{await call.code()}"
                        kind = check_response(seen, resp, first=sent[i] == 0, secret=secret[i])
                        answered[i] = kind == "immediate_response"
                        if sent[i] == 0:
                            firsts[i] = resp
                            if kind == "request_body":
                                counted[i] = Counted(primary_of(resp), primary_of(resp))
                                request_ids[i] = _request_id(seen)
                                if request_ids[i]:  # the servicer registered it before answering
                                    registry[request_ids[i]] = i
                        sent[i] += 1
                    assert_counts(gw, counted)
                    assert servicer.open_streams == sum(c is not None for c in calls) - sum(ended)
                    routed_acme = sum(1 for j in counted if _tenant_of(_attrs(scripts[j][0][1]).get(AUTH, "")) == "acme")
                    assert routed_acme <= gw.admission.in_flight("acme") <= 1
            assert all(ended) and servicer.open_streams == 0
            for request_id in ids:  # every stream ended: no report reaches anything
                report(request_id, "10.0.0.9:8000")
            assert_nothing_held(gw)
        finally:
            await server.stop(0)
            await gw.admission.close()

    try:
        asyncio.run(run())
    finally:
        logger.removeHandler(failures)
    assert not failures.records, [r.getMessage() for r in failures.records]


@pytest.mark.parametrize("junk", [b"\xff\xfe\xfd\xfc", b"Bearer \xff\xfe" + KEY.encode(),
                                  b"Bearer " + KEY.encode() + b"\xc3", b"\xed\xa0\x80" * 3])
async def test_grpc_authorization_attribute_not_utf8_gets_401(junk: bytes) -> None:
    """Envoy copies the Authorization header's bytes into a protobuf string; bytes that are not UTF-8 must be
    an unknown key (401 JSON), not a grpc error that breaks the request."""
    gw = make_gateway()
    server, servicer, port, finished = await _serve(gw)
    failures = _Failures()
    logging.getLogger("modeldock.extproc").addHandler(failures)
    try:
        raw = _corrupt(body_msg(b'{"model":"llama-8b"}'), {(ATTR, AUTH): junk})
        with pytest.raises(message.DecodeError):  # what upb alone would do with it
            ep.ProcessingRequest.FromString(raw)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = _raw_process(channel)()
            await call.write(raw)
            resp = await call.read()
            assert resp is not grpc.aio.EOF, f"stream broken: {await call.code()} {await call.details()}"
            assert resp.WhichOneof("response") == "immediate_response", resp
            imm = resp.immediate_response
            assert imm.status.code == 401
            err = json.loads(imm.body)["error"]
            assert err["type"] == "invalid_request_error"
            assert err["code"] in ("invalid_api_key", "invalid_authorization"), err
            assert KEY.encode() not in resp.SerializeToString()
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
            await _until(lambda: servicer.open_streams == 0 and len(finished) == 1)
        assert finished[0].outcome == "rejected" and finished[0].status == 401
        assert_nothing_held(gw)
    finally:
        logging.getLogger("modeldock.extproc").removeHandler(failures)
        await server.stop(0)
    assert not failures.records, [r.getMessage() for r in failures.records]


async def test_grpc_other_attribute_not_utf8_is_routed() -> None:
    """Bytes that are not UTF-8 in another attribute (here the request id) do not stop a good request; its
    retries are reported under the id as ext_proc read it."""
    gw = make_gateway()
    reached: list[RequestFlow] = []
    server, servicer, port, finished = await _serve(gw, reached.append)
    try:
        msg = body_msg(b'{"model":"llama-70b"}', auth=f"Bearer {FREE_KEY}")
        raw = _corrupt(msg, {(ATTR, "request.id"): b"\xffid\xfe"})
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = _raw_process(channel)()
            await call.write(raw)
            resp = await call.read()
            assert resp is not grpc.aio.EOF, f"stream broken: {await call.code()}"
            assert check_routed(_decoded(msg, {(ATTR, "request.id"): b"\xffid\xfe"}), resp) == "llama-70b"
            assert gw.picker.in_flight(Endpoint.parse("10.0.0.3:8000")) == gw.picker.total_in_flight() == 1
            _add_retry_targets(gw, "llama-70b", "10.0.0.9:8000")  # a lease only moves within its model
            servicer.retried("r-1", "10.0.0.9:8000")  # the id as sent was never read: no such request
            assert not reached and gw.picker.in_flight(Endpoint.parse("10.0.0.3:8000")) == 1
            servicer.retried("\ufffdid\ufffd", "10.0.0.9:8000")
            assert len(reached) == 1 and reached[0].retried
            assert gw.picker.in_flight(Endpoint.parse("10.0.0.9:8000")) == gw.picker.total_in_flight() == 1
            # A later message with bad bytes (Envoy sends none) goes on unchanged.
            stray = _corrupt(reply_msg("200"), {(ATTR, "request.path"): b"/v1/\xff\xff"})
            await call.write(stray)
            later = await call.read()
            assert later.WhichOneof("response") == "response_headers" and _changes_nothing(later), later
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            await _until(lambda: servicer.open_streams == 0 and len(finished) == 1)
        assert finished[0].outcome == "proxied" and finished[0].head.request_id == "\ufffdid\ufffd"
        assert_nothing_held(gw)
        servicer.retried("\ufffdid\ufffd", "10.0.0.3:8000")  # the stream ended
        assert len(reached) == 1
        assert_nothing_held(gw)
    finally:
        await server.stop(0)


async def test_grpc_duplicate_request_ids() -> None:
    """A client may send its own x-request-id, so two live requests can share one. Reports go to the one
    routed last while it is live; the first one's end must not unregister the second."""
    gw = make_gateway()
    reached: list[RequestFlow] = []
    server, servicer, port, finished = await _serve(gw, reached.append)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            calls = [_raw_process(channel)() for _ in range(2)]
            for call in calls:  # free has no limits: both are routed
                await call.write(body_msg(b'{"model":"llama-70b"}', auth=f"Bearer {FREE_KEY}",
                                          request_id="dup").SerializeToString())
                assert (await call.read()).WhichOneof("response") == "request_body"
            assert gw.picker.in_flight(Endpoint.parse("10.0.0.3:8000")) == 2
            _add_retry_targets(gw, "llama-70b", "10.0.0.9:8000", "[::1]:8000")  # a lease only moves within its model
            servicer.retried("dup", "10.0.0.9:8000")
            second = reached[-1]
            assert gw.picker.in_flight(Endpoint.parse("10.0.0.9:8000")) == 1
            await calls[0].done_writing()
            assert await calls[0].read() is grpc.aio.EOF
            await _until(lambda: len(finished) == 1)
            assert finished[0] is not second
            assert gw.picker.in_flight(Endpoint.parse("10.0.0.3:8000")) == 0
            servicer.retried("dup", "[::1]:8000")  # still the second's
            assert reached[-1] is second and len(reached) == 2
            assert gw.picker.in_flight(Endpoint.parse("[::1]:8000")) == gw.picker.total_in_flight() == 1
            calls[1].cancel()
            await _until(lambda: servicer.open_streams == 0 and len(finished) == 2)
            assert finished[1] is second
            servicer.retried("dup", "10.0.0.3:8000")
            assert len(reached) == 2
        assert_nothing_held(gw)
    finally:
        await server.stop(0)


async def test_grpc_client_gone_while_waiting_for_redis_holds_nothing() -> None:
    redis = FakeRedis("up")
    redis.gate = asyncio.Event()
    gw = make_gateway("up", redis)
    server, servicer, port, finished = await _serve(gw)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = ep_grpc.ExternalProcessorStub(channel).Process()
            await call.write(body_msg(b'{"model":"llama-8b"}'))
            await _until(lambda: gw.admission.in_flight("acme") == 1)
            call.cancel()
            await _until(lambda: servicer.open_streams == 0 and len(finished) == 1)
        assert_nothing_held(gw)
        assert finished[0].lease is None  # never picked: the client left during admission
        assert finished[0].outcome == "incomplete"
        servicer.retried("r-1", "10.0.0.2:8000")  # never routed, so never registered
        assert_nothing_held(gw)
    finally:
        await server.stop(0)


# ---------------------------------------------------------------- known bugs


@pytest.mark.parametrize("status", ["404", "413", "503", "200", "²"])
async def test_response_headers_first_are_refused(status: str) -> None:
    """Envoy's own replies (a bodiless request's 404, a too-big body's 413) used to reach ext_proc as a first
    response_headers; Envoy now writes them itself, so any such message is out of order."""
    gw = make_gateway()
    flow = RequestFlow(gw)
    first = reply_msg(status)
    resp = await flow.handle(first)
    check_response(first, resp, first=True)
    assert resp.immediate_response.status.code == 400
    assert json.loads(resp.immediate_response.body)["error"]["code"] == "invalid_request"
    # Nothing after it is routed, and nothing is counted.
    later = body_msg(b'{"model":"llama-8b"}')
    check_response(later, await flow.handle(later), first=False)
    flow.retried_on("10.0.0.1:8000")
    assert_nothing_held(gw)
    assert (flow.outcome, flow.status) == ("rejected", 400)


@pytest.mark.parametrize(("before", "malformed"), [(None, "garbage"), ("10.0.0.9:8000", "")])
async def test_a_malformed_retry_report_is_ignored(before: str | None, malformed: str) -> None:
    """`retried` once said the opposite of where the request was counted after a malformed report."""
    gw = make_gateway()
    flow = RequestFlow(gw)
    await flow.handle(body_msg(b'{"model":"llama-8b"}'))
    if before is not None:
        _add_retry_targets(gw, "llama-8b", before)  # a lease only moves within its model
        flow.retried_on(before)
    served_by, retried = flow.served_by, flow.retried
    flow.retried_on(malformed)  # found by test_one_flow_any_messages
    assert gw.picker.in_flight(Endpoint.parse(before or flow.primary)) == 1  # the lease did ignore it
    assert (flow.served_by, flow.retried) == (served_by, retried)
    flow.finish()
    assert_nothing_held(gw)


async def test_models_request_with_a_non_ascii_content_length() -> None:
    msg = models_msg((":method", "GET"), (":path", "/v1/models"), ("content-length", "²"),
                     ("authorization", f"Bearer {KEY}"))
    resp = await RequestFlow(make_gateway()).handle(msg)
    check_response(msg, resp, first=True)
    assert resp.immediate_response.status.code == 200


@pytest.mark.parametrize("value", [7, True, None, [f"Bearer {KEY}"], {"a": f"Bearer {KEY}"}])
async def test_authorization_attribute_that_is_not_a_string(value: Any) -> None:
    """Envoy sends strings; anything else is no Authorization header at all."""
    gw = make_gateway()
    msg = body_msg(b'{"model":"llama-8b"}', auth=None, extra={AUTH: value})
    resp = await RequestFlow(gw).handle(msg)
    check_response(msg, resp, first=True)
    assert resp.immediate_response.status.code == 401
    assert json.loads(resp.immediate_response.body)["error"]["code"] == "missing_api_key"
    assert_nothing_held(gw)


@pytest.mark.parametrize("number", ["1e999", "-1e400", "1E+309"])
async def test_alias_rewrite_with_a_number_past_a_double(number: str) -> None:
    """Python reads 1e999 as infinity; rewriting an alias's body must not send `Infinity` (not JSON) upstream."""
    gw = make_gateway()
    msg = body_msg(f'{{"model":"llama-70b","temperature":{number}}}'.encode(), auth=f"Bearer {FREE_KEY}")
    flow = RequestFlow(gw)
    resp = await flow.handle(msg)
    check_response(msg, resp, first=True)
    assert resp.immediate_response.status.code == 400
    assert json.loads(resp.immediate_response.body)["error"]["code"] == "invalid_json"
    flow.finish()
    assert_nothing_held(gw)
