"""Fuzzing the ext_proc state machine with random ProcessingRequest messages.

Envoy's protocol (docs/envoy.md): a completion request arrives as one `request_body` message
carrying the request's method, path, id and Authorization header as attributes, then its
`response_headers` (with `upstream.address`); only `GET /v1/models` sends `request_headers`; a
request without a body arrives as Envoy's own 404 (or 413) `response_headers`.

Random phase kinds in random order, random headers (raw and string values, arbitrary bytes),
random bodies and random attributes (absent, non-string, arbitrary text, repeated Authorization
headers joined with ","), and plausible requests with at most one fault, sent to `RequestFlow`
directly (one flow, and several flows interleaved with early finishes) and through the real
grpc.aio servicer in process, where attribute strings may also be invalid UTF-8 on the wire.
Invariants:

- every answer is a ProcessingResponse of the kind asked or an immediate_response, and only the
  first message of a stream can be answered with an immediate_response;
- no exception escapes (only a task cancellation may, and that holds nothing either);
- rejections are OpenAI-style JSON with a status that matches the error type; no header we set
  carries CR, LF or NUL; ext_proc never mutates request headers (Envoy strips them itself);
- a request is routed (dynamic metadata with the cluster and endpoints) only when it is a POST to a
  completion path with exactly one valid Bearer key that may use the model; the API keys appear in
  no answer unless the client also put them where answers echo (path, body);
- after `finish()` (or the end of the gRPC stream), every in-flight count and concurrency slot is 0.

The regression tests at the end pin inputs the fuzzer once found (see test_request_properties.py
for the parser side).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
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
from modeldock.discovery.snapshot import Endpoint
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
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


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


def make_gateway(mode: str = "none", redis: FakeRedis | None = None) -> Gateway:
    data = json.loads(json.dumps(CONFIG))
    if mode != "none":
        data["limits"].update(redis_url="redis://fuzz.invalid:6379/0", redis_fail_open=mode == "down-open")
    config = parse_config(data)
    clock = FakeClock()
    fake = redis or FakeRedis(mode)
    gw = Gateway(config, clock, Picker(clock), Admission(config, clock, redis_client_factory=lambda _u, _t: fake))
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


def response_msg(status: str, upstream: str | None = None, method: str = "POST",
                 path: str = "/v1/completions") -> ep.ProcessingRequest:
    values = {"request.method": method, "request.path": path}
    if upstream is not None:
        values["upstream.address"] = upstream
    msg = _headers_msg("response_headers", _raw_headers((":status", status)), False)
    return _with_attrs(msg, {ATTR: _struct(values)})


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
addresses = st.one_of(
    st.sampled_from([*ENDPOINTS["llama-8b"], *ENDPOINTS["llama-70b"], "10.0.0.9:8000", "[::1]:8000", "garbage", "",
                     "10.0.0.1:0", "10.0.0.1:99999", "10.0.0.1:²"]),
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


@st.composite
def header_value(draw: st.DrawFn) -> base_pb2.HeaderValue:
    key = draw(header_keys)
    how = draw(st.sampled_from(["raw", "value", "bytes"]))
    if how == "bytes":
        raw = draw(st.binary(max_size=24))
        return base_pb2.HeaderValue(key=key, raw_value=raw)
    text = draw(text_values)
    if how == "raw":
        return base_pb2.HeaderValue(key=key, raw_value=text.encode())
    return base_pb2.HeaderValue(key=key, value=text)


ATTRIBUTE_FIELDS = {"request.method": methods, "request.path": paths, "request.id": st.text(max_size=12),
                    AUTH: auth_values, "upstream.address": addresses}


@st.composite
def attribute_struct(draw: st.DrawFn) -> struct_pb2.Struct:
    """Envoy's attributes, each absent, a string, or (never from Envoy) some other JSON value."""
    values: dict[str, Any] = {}
    for name, strategy in ATTRIBUTE_FIELDS.items():
        how = draw(st.sampled_from(["absent", "string", "string", "other"]))
        if how == "string":
            values[name] = draw(strategy)
        elif how == "other":
            values[name] = draw(not_strings)
    values.update(draw(st.dictionaries(st.text(max_size=8), st.one_of(text_values, not_strings), max_size=2)))
    return _struct(values)


@st.composite
def attributes(draw: st.DrawFn) -> dict[str, struct_pb2.Struct]:
    names = draw(st.lists(st.one_of(st.just(ATTR), st.just(ATTR), st.sampled_from(["envoy.lb", "modeldock"]),
                                    st.text(max_size=10)), max_size=2, unique=True))
    return {name: draw(attribute_struct()) for name in names}


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
    st.builds(lambda s, a: _with_attrs(_headers_msg("response_headers", _raw_headers((":status", s)), False), a),
              st.sampled_from(["200", "404", "413", "503", "", "²"]), attributes()),
    st.builds(lambda b, e: ep.ProcessingRequest(response_body=ep.HttpBody(body=b, end_of_stream=e)),
              st.binary(max_size=32), st.booleans()),
    st.builds(lambda h: ep.ProcessingRequest(request_trailers=ep.HttpTrailers(trailers=base_pb2.HeaderMap(headers=h))),
              st.lists(header_value(), max_size=3)),
    st.builds(lambda h: ep.ProcessingRequest(response_trailers=ep.HttpTrailers(trailers=base_pb2.HeaderMap(headers=h))),
              st.lists(header_value(), max_size=3)),
    st.just(ep.ProcessingRequest()),  # no phase set at all
)


# What a request should get as the answer to its first message:
# ("routed", tenant, model) | ("models", tenant) | ("continued",) | ("rejected", status, {codes}) | None (any).
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


@st.composite
def plausible_request(draw: st.DrawFn) -> tuple[list[ep.ProcessingRequest], Expected]:
    """A good request as Envoy sends it, with at most one thing wrong, and the answer it should get."""
    fault = draw(st.sampled_from(["none", "none", "method", "path", "auth", "model", "body", "limit", "models",
                                  "bodiless", "local_reply", "headers_first", "stray"]))
    key = draw(st.sampled_from([KEY, FREE_KEY]))
    tenant = TENANT_OF[key]
    method = "POST"
    path = draw(st.sampled_from([*COMPLETIONS, "/v1/completions?x=1"]))
    auth: str | None = draw(st.sampled_from([f"Bearer {key}", f"bearer  {key}", f" Bearer {key} ", f"BEARER {key}"]))
    model: Any = draw(st.sampled_from(["llama-8b", "llama-70b"]))
    request_id = draw(st.one_of(st.none(), st.just("r-2"), st.text(max_size=10)))
    extra = draw(st.dictionaries(st.text(max_size=8), st.one_of(text_values, not_strings), max_size=2))
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
    elif fault in ("bodiless", "local_reply"):
        # No body: Envoy answered by itself and ext_proc sees only that reply's headers.
        if fault == "bodiless":
            status = "404"
            method = draw(st.sampled_from(["POST", "GET", "DELETE"]))
            path = draw(st.sampled_from([*COMPLETIONS, "/v1/completions?x=1", "/v1/embeddings", "/", "/v1/models"]))
            if path.split("?")[0] not in COMPLETIONS:
                expected = _rejected(404, "unknown_url")
            elif method != "POST":
                expected = _rejected(400, "method_not_allowed")
            else:
                expected = _rejected(400, "invalid_body")
        else:
            status = draw(st.sampled_from(["413", "413", "0413", "200", "400", "503", "", "4l3"]))
            expected = _rejected(413, "request_too_large") if status in ("413", "0413") else ("continued",)
        return [response_msg(status, method=method, path=path)], expected
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
    first = body_msg(body, method, path, auth, request_id, extra)
    served = draw(st.sampled_from([*ENDPOINTS["llama-8b"], *ENDPOINTS["llama-70b"], "10.0.0.9:8000", "junk"]))
    status = draw(st.sampled_from(["200", "503", "", "abc"]))
    return [first, response_msg(status, served, method, path)], expected


plausible_messages = plausible_request().map(lambda case: case[0])


@st.composite
def valid_prefix(draw: st.DrawFn) -> list[ep.ProcessingRequest]:
    """What Envoy sends for a good completion request, cut at a random point."""
    key = draw(st.sampled_from([KEY, FREE_KEY]))
    model = draw(st.sampled_from(["llama-8b", "llama-70b"]))
    path = draw(st.sampled_from(COMPLETIONS))
    full = [body_msg(json.dumps({"model": model, "prompt": "x"}).encode(), path=path, auth=f"Bearer {key}"),
            response_msg(draw(st.sampled_from(["200", "503", "", "abc"])),
                         draw(st.sampled_from([*ENDPOINTS[model], "10.0.0.9:8000", "junk"])), path=path)]
    return full[: draw(st.integers(0, len(full)))]


sequences = st.one_of(
    st.lists(random_message, max_size=8),
    st.builds(lambda p, g: p + g, valid_prefix(), st.lists(random_message, max_size=5)),
    st.builds(lambda p, g: p + g, plausible_messages, st.lists(random_message, max_size=4)),
)


# ---------------------------------------------------------------- invariants


def _attrs(msg: ep.ProcessingRequest) -> dict[str, str]:
    """The string attributes Envoy sent under ext_proc's namespace."""
    if ATTR not in msg.attributes:
        return {}
    return {k: v.string_value for k, v in msg.attributes[ATTR].fields.items() if v.WhichOneof("kind") == "string_value"}


def _request_status(msg: ep.ProcessingRequest) -> int | None:
    """The :status of a response_headers message (the first one), if it is a plain number."""
    for h in msg.response_headers.headers.headers:
        if h.key == ":status":
            value = h.raw_value.decode("utf-8", "surrogateescape") if h.raw_value else h.value
            return int(value) if value.isascii() and value.isdigit() else None
    return None


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


def _plain(common: ep.CommonResponse) -> None:
    """An answer that changes nothing."""
    assert not common.header_mutation.set_headers and not common.header_mutation.remove_headers, common
    assert not common.HasField("body_mutation") and not common.clear_route_cache and not common.HasField("trailers")
    assert common.status == ep.CommonResponse.CONTINUE


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
    the cluster and endpoint list are dynamic metadata, and no request header is changed. Returns the model."""
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
    route = meta["modeldock"]
    assert route["cluster"] == f"model:{model}", route
    if model == "llama-70b":  # an alias: the body names the served model, and Envoy fixes content-length
        rewritten = common.body_mutation.body
        assert _strict_json(rewritten) == {**data, "model": "meta/llama-70b"}
        assert route == {"cluster": "model:llama-70b", "content_length": str(len(rewritten))}, route
    else:
        assert not common.HasField("body_mutation")
        assert set(route) == {"cluster"}, route
    return model


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
    if asked == "response_headers":
        # A reply Envoy made by itself: only its 404 (no body) and 413 (too big) are rewritten.
        status = _request_status(request)
        if status == 413:
            assert (imm.status.code, err["code"]) == (413, "request_too_large")
        else:
            assert status == 404, status
            assert (imm.status.code, err["code"]) in {(404, "unknown_url"), (400, "method_not_allowed"),
                                                      (400, "invalid_body")}, err
    elif asked != "request_body" and asked != "request_headers":
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
    assert not resp.HasField("dynamic_metadata") and not resp.HasField("mode_override"), resp
    if kind.endswith("trailers"):
        assert not getattr(resp, kind).HasField("header_mutation")
        return kind
    common = getattr(resp, kind).response
    if kind == "response_headers" and not first:
        # The upstream's answer: at most the rate-limit headers are added.
        _mutation_ok(common.header_mutation)
        assert {h.header.key for h in common.header_mutation.set_headers} <= RATELIMIT_HEADERS
        assert not common.header_mutation.remove_headers and not common.HasField("body_mutation")
        assert not common.clear_route_cache
        return kind
    if first:
        # Only a reply Envoy made by itself goes on unchanged as a first message; a first request_headers
        # (only /v1/models sends them) is always answered by ext_proc.
        assert kind == "response_headers", kind
        assert _request_status(request) not in (404, 413)
    _plain(common)
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
    elif expected[0] == "continued":
        assert kind == "response_headers", resp
    else:
        _, status, codes = expected
        assert kind == "immediate_response", resp
        assert resp.immediate_response.status.code == status, resp
        assert json.loads(resp.immediate_response.body)["error"]["code"] in codes, resp


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


@FUZZ
@given(mode=st.sampled_from(REDIS_MODES), messages=sequences)
def test_one_flow_any_messages(mode: str, messages: list[ep.ProcessingRequest]) -> None:
    async def run() -> None:
        gw = make_gateway(mode)
        flow = RequestFlow(gw)
        secret = keys_only_in_authorization(messages)
        routed = False
        for i, msg in enumerate(messages):
            kind = check_response(msg, await flow.handle(msg), first=i == 0, secret=secret)
            routed = routed or (i == 0 and kind == "request_body")
            # Only a routed request holds a lease; it also holds a ticket. (An admitted request the picker then
            # rejects, e.g. no endpoints, keeps its ticket until the stream ends.)
            assert (flow.lease is not None) == routed
            assert flow.ticket is not None or not routed
            assert gw.picker.total_in_flight() == (1 if routed else 0)
            held = flow.ticket is not None and flow.tenant is not None and flow.tenant.id == "acme"
            assert gw.admission.in_flight("acme") == (1 if held else 0)
        flow.finish()
        assert_nothing_held(gw)
        flow.finish()  # idempotent
        assert_nothing_held(gw)
        await gw.admission.close()

    asyncio.run(run())


@FUZZ
@given(mode=st.sampled_from(REDIS_MODES), case=plausible_request(), tail=st.lists(random_message, max_size=3))
def test_plausible_request_gets_its_answer(mode: str, case: tuple[list[ep.ProcessingRequest], Expected],
                                           tail: list[ep.ProcessingRequest]) -> None:
    """A request with one fault gets exactly the rejection for that fault; a good one is routed, counted where
    Envoy says it was served, and answered with rate-limit headers when its tenant has limits."""
    messages, expected = case
    messages = messages + tail

    async def run() -> None:
        gw = make_gateway(mode)
        flow = RequestFlow(gw)
        secret = keys_only_in_authorization(messages)
        first = await flow.handle(messages[0])
        check_response(messages[0], first, first=True, secret=secret)
        check_expected(expected, first, mode)
        routed = first.WhichOneof("response") == "request_body"
        if routed:
            assert flow.lease is not None and flow.ticket is not None
            primary = json_format.MessageToDict(first.dynamic_metadata)["envoy.lb"][
                "x-gateway-destination-endpoint"].split(",")[0]
            assert gw.picker.in_flight(Endpoint.parse(primary)) == gw.picker.total_in_flight() == 1
            assert gw.admission.in_flight(flow.tenant.id) == 1
        else:
            assert gw.picker.total_in_flight() == 0 and flow.lease is None
        for i, msg in enumerate(messages[1:]):
            resp = await flow.handle(msg)
            check_response(msg, resp, first=False, secret=secret)
            if routed and i == 0:  # the response headers: count the request where Envoy says it went
                served = _attrs(msg)["upstream.address"]
                try:
                    where = Endpoint.parse(served)
                except ValueError:
                    where = Endpoint.parse(primary)
                assert gw.picker.in_flight(where) == gw.picker.total_in_flight() == 1
                added = {h.header.key for h in resp.response_headers.response.header_mutation.set_headers}
                assert added == (RATELIMIT_HEADERS if flow.tenant.id == "acme" else set()), added
        flow.finish()
        assert_nothing_held(gw)
        await gw.admission.close()

    asyncio.run(run())


@FUZZ
@given(mode=st.sampled_from(REDIS_MODES),
       scripts=st.lists(st.one_of(sequences, plausible_messages, valid_prefix()), min_size=2, max_size=6),
       data=st.data())
def test_interleaved_flows_with_early_finishes(mode: str, scripts: list[list[ep.ProcessingRequest]],
                                               data: st.DataObject) -> None:
    """Several requests at once, their messages interleaved at random; a flow may end at any point
    (client gone). The gateway's counts always match what the flows hold."""
    # One step per message plus one to end the stream, in a random interleaving.
    steps = data.draw(st.permutations([i for i, script in enumerate(scripts) for _ in range(len(script) + 1)]))

    async def run() -> None:
        gw = make_gateway(mode)
        flows = [RequestFlow(gw) for _ in scripts]
        secret = [keys_only_in_authorization(script) for script in scripts]
        sent = [0] * len(scripts)
        ended = [False] * len(scripts)
        for i in steps:
            if ended[i]:
                continue
            if sent[i] == len(scripts[i]) or data.draw(st.integers(0, 9)) == 0:  # sometimes the client leaves early
                flows[i].finish()
                ended[i] = True
            else:
                msg = scripts[i][sent[i]]
                check_response(msg, await flows[i].handle(msg), first=sent[i] == 0, secret=secret[i])
                sent[i] += 1
            leases, tickets = live(flows)
            assert gw.picker.total_in_flight() == leases
            assert gw.admission.in_flight("acme") == tickets <= 1  # max_in_flight
        assert all(ended)
        assert_nothing_held(gw)
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


async def _serve(gw: Gateway) -> tuple[grpc.aio.Server, ExtProcServicer, int, list[RequestFlow]]:
    finished: list[RequestFlow] = []
    servicer = ExtProcServicer(gw, lambda flow, _s: finished.append(flow))
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


@st.composite
def wire_script(draw: st.DrawFn) -> list[tuple[bytes, ep.ProcessingRequest]]:
    """A message sequence as bytes on the wire (some attribute strings made invalid UTF-8), each with what
    ext_proc should read from it."""
    out = []
    for msg in draw(sequences.filter(bool)):
        junk = draw(corruptions(msg)) if draw(st.booleans()) else {}
        if junk and _all_strings(msg):
            out.append((_corrupt(msg, junk), _decoded(msg, junk)))
        elif junk:
            raw = _corrupt(msg, junk)
            out.append((raw, parse_request(raw)))  # non-string attributes: checked by the test above
        else:
            out.append((msg.SerializeToString(), msg))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(REDIS_MODES), scripts=st.lists(wire_script(), min_size=1, max_size=4),
       endings=st.lists(st.sampled_from(["done_writing", "cancel"]), min_size=4, max_size=4))
def test_grpc_servicer_streams(mode: str, scripts: list[list[tuple[bytes, ep.ProcessingRequest]]],
                               endings: list[str]) -> None:
    failures = _Failures()
    logger = logging.getLogger("modeldock.extproc")
    logger.addHandler(failures)

    async def one_stream(process: grpc.aio.StreamStreamMultiCallable, script: list[tuple[bytes, ep.ProcessingRequest]],
                         ending: str) -> None:
        call = process()
        secret = keys_only_in_authorization([seen for _, seen in script])
        for i, (raw, seen) in enumerate(script):
            await call.write(raw)
            resp = await call.read()
            assert resp is not grpc.aio.EOF, f"the server ended the stream instead of answering: {await call.code()}"
            if check_response(seen, resp, first=i == 0, secret=secret) == "immediate_response":
                break  # Envoy stops here
        if ending == "cancel":
            call.cancel()
        else:
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK

    async def run() -> None:
        gw = make_gateway(mode)
        server, servicer, port, finished = await _serve(gw)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                process = _raw_process(channel)
                await asyncio.gather(*(one_stream(process, s, e) for s, e in zip(scripts, endings, strict=False)))
                # The servicer ends every flow when its stream ends, cancelled or not.
                await _until(lambda: servicer.open_streams == 0 and len(finished) == len(scripts))
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
    """Bytes that are not UTF-8 in another attribute (here the request id) do not stop a good request."""
    gw = make_gateway()
    server, servicer, port, finished = await _serve(gw)
    try:
        msg = body_msg(b'{"model":"llama-70b"}', auth=f"Bearer {FREE_KEY}")
        raw = _corrupt(msg, {(ATTR, "request.id"): b"\xffid\xfe"})
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = _raw_process(channel)()
            await call.write(raw)
            resp = await call.read()
            assert resp is not grpc.aio.EOF, f"stream broken: {await call.code()}"
            assert check_routed(_decoded(msg, {(ATTR, "request.id"): b"\xffid\xfe"}), resp) == "llama-70b"
            assert gw.picker.total_in_flight() == 1
            reply = _corrupt(response_msg("200", "10.0.0.3:8000"), {(ATTR, "request.path"): b"/v1/\xff\xff"})
            await call.write(reply)
            assert (await call.read()).WhichOneof("response") == "response_headers"
            assert gw.picker.in_flight(Endpoint.parse("10.0.0.3:8000")) == 1
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            await _until(lambda: servicer.open_streams == 0 and len(finished) == 1)
        assert finished[0].outcome == "proxied" and finished[0].head.request_id == "\ufffdid\ufffd"
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
    finally:
        await server.stop(0)


# ---------------------------------------------------------------- known bugs


async def test_response_status_with_a_non_ascii_digit() -> None:
    gw = make_gateway()
    flow = RequestFlow(gw)
    assert (await flow.handle(body_msg(b'{"model":"llama-8b"}'))).WhichOneof("response") == "request_body"
    resp = await flow.handle(_headers_msg("response_headers", _raw_headers((":status", "²")), False))
    assert resp.WhichOneof("response") == "response_headers"
    flow.finish()
    assert_nothing_held(gw)
    # As Envoy's own reply: not a 404 or 413, so it goes on unchanged.
    first = _headers_msg("response_headers", _raw_headers((":status", "4²4")), False)
    resp = await RequestFlow(gw).handle(first)
    check_response(first, resp, first=True)
    assert resp.WhichOneof("response") == "response_headers"


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
