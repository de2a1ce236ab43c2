"""Hypothesis strategies for the ext_proc fuzz tests: random and plausible messages, bodies, attributes."""

from __future__ import annotations

import json
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from hypothesis import strategies as st

from modeldock.extproc.wire import parse_request
from tests.support.extproc_messages import ATTR, AUTH, headers_request, raw_headers, struct, with_attributes
from tests.unit.extproc.flow_fuzz_setup import (
    COMPLETIONS,
    ENDPOINTS,
    FREE_KEY,
    KEY,
    LIMIT,
    TENANT_OF,
    TENANTS,
    all_strings,
    body_msg,
    corrupt,
    corruptions,
    decoded,
    reply_msg,
)

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
    return struct(values)


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
    st.builds(lambda h, e, a: with_attributes(headers_request(h, end_of_stream=e), a),
              st.lists(header_value(), max_size=8), st.booleans(), attributes()),
    st.builds(
        lambda b, e, a: with_attributes(ep.ProcessingRequest(request_body=ep.HttpBody(body=b, end_of_stream=e)), a),
        bodies(), st.booleans(), attributes()),
    st.builds(lambda h, a: with_attributes(headers_request(h, end_of_stream=False, field="response_headers"), a),
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


def rejected(status: int, *codes: str) -> Expected:
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
    "nope": ("nope", {t: rejected(404, "model_not_found") for t in TENANTS}),
    "glob": ("llama-*", {t: rejected(404, "model_not_found") for t in TENANTS}),
    "empty": ("", {t: rejected(400, "invalid_model") for t in TENANTS}),
    "crlf": ("llama-8b\r\nx: y", {t: rejected(400, "invalid_model") for t in TENANTS}),
    "long": ("m" * 257, {t: rejected(400, "invalid_model") for t in TENANTS}),
    "int": (7, {t: rejected(400, "invalid_model") for t in TENANTS}),
    "list": (["llama-8b"], {t: rejected(400, "invalid_model") for t in TENANTS}),
    "null": (None, {t: rejected(400, "missing_model") for t in TENANTS}),
    # acme may not use it; free may, but no endpoint was ever announced for it.
    "mistral": ("mistral", {"acme": rejected(404, "model_not_found"),
                            "free": rejected(503, "no_ready_endpoints")}),
}


def padded(model: str, size: int) -> bytes:
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
        expected = rejected(400, "method_not_allowed")
    elif fault == "path":
        path = draw(st.sampled_from(["/v1/embeddings", "/", "", "/v1/chat/completions/x", "v1/completions",
                                     "/v1/models", "/V1/completions"]))
        expected = rejected(404, "unknown_url")
    elif fault == "auth":
        auth = draw(st.sampled_from(list(AUTH_FAULTS)))
        expected = rejected(401, AUTH_FAULTS[auth])
    elif fault == "model":
        model, outcomes = MODEL_FAULTS[draw(st.sampled_from(sorted(MODEL_FAULTS)))]
        expected = outcomes[tenant]
    elif fault == "body":
        body = draw(bodies())
        expected = None
    elif fault == "limit":
        over = draw(st.booleans())
        body = padded(model, LIMIT + 1 if over else LIMIT)
        if over:
            expected = rejected(413, "request_too_large")
    elif fault == "models":
        models_path = draw(st.sampled_from(["/v1/models", "/v1/models?limit=1"]))
        broken = draw(st.sampled_from(["none", "none", "method", "auth"]))
        pairs = [(":method", "GET"), (":path", models_path), ("x-request-id", "r-3")]
        if broken == "method":
            pairs[0] = (":method", draw(st.sampled_from(["POST", "PUT", "get"])))
            expected = rejected(400, "method_not_allowed")
        if broken == "auth":
            bad = draw(st.sampled_from([a for a in AUTH_FAULTS if a is None or "," not in a]))
            if bad is not None:
                pairs.append(("authorization", bad))
            expected = rejected(401, AUTH_FAULTS[bad])
        else:
            pairs.append(("authorization", f"Bearer {key}"))
            if broken == "none":
                expected = ("models", tenant)
        headers = raw_headers(*pairs) + draw(st.lists(header_value().filter(
            lambda h: h.key not in (":method", ":path", "authorization")), max_size=2))
        return [headers_request(headers)], expected
    elif fault == "reply_first":
        # Response headers first, such as Envoy's own 404 or 413 used to be: never ext_proc's to answer now.
        status = draw(st.sampled_from(["404", "413", "200", "503", "", "4²4"]))
        method = draw(st.sampled_from(["POST", "GET"]))
        then_body = body_msg(json.dumps({"model": model}).encode(), path=path, auth=auth)
        return [reply_msg(status, method, path), then_body], rejected(400, "invalid_request")
    elif fault == "headers_first":
        # A completion route never sends its headers; if it did, nothing may go upstream from them.
        msg = headers_request(raw_headers((":method", "POST"), (":path", path),
                                                           ("authorization", f"Bearer {key}")), end_of_stream=False)
        return [msg, body_msg(json.dumps({"model": model}).encode(), path=path, auth=auth)], \
            rejected(400, "invalid_request")
    elif fault == "stray":
        first = draw(st.sampled_from([
            ep.ProcessingRequest(request_trailers=ep.HttpTrailers()),
            ep.ProcessingRequest(response_trailers=ep.HttpTrailers()),
            ep.ProcessingRequest(response_body=ep.HttpBody(body=b"x", end_of_stream=True)),
            ep.ProcessingRequest(),
        ]))
        return [first, body_msg(json.dumps({"model": model}).encode(), path=path, auth=auth)], \
            rejected(400, "invalid_request")
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

# Envoy's retry reports between two steps (out of band: they may come at any time).
reports = st.lists(addresses, max_size=2)

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
        if junk and all_strings(msg):
            out.append((corrupt(msg, junk), decoded(msg, junk)))
        elif junk:
            raw = corrupt(msg, junk)
            out.append((raw, parse_request(raw)))  # non-string attributes: checked by the test above
        else:
            out.append((msg.SerializeToString(), msg))
    return out
