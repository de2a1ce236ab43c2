"""Properties of the request parsers: `parse_body`, `bearer_key`, `read_head` and `head_from_attributes`
raise nothing but a
`modeldock.errors.Rejection` on any input, and accept every valid input.

The regression tests at the end pin inputs the properties once found: digits int() refuses and
integers past Python's 4300-digit conversion limit.
"""

from __future__ import annotations

import json
import re
import string
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from modeldock.errors import BadRequest, PayloadTooLarge, Rejection, Unauthorized
from modeldock.gateway.request import (
    RequestHead,
    bearer_key,
    check_length,
    head_from_attributes,
    parse_body,
    read_head,
)

SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

# JSON values.
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
valid_models = st.text(min_size=1, max_size=256).filter(lambda m: not CONTROL.search(m))


@st.composite
def mutated_json(draw: st.DrawFn) -> bytes:
    """Valid JSON (often a request-shaped object), then maybe truncated, spliced or re-encoded."""
    value = draw(st.one_of(
        json_values,
        st.fixed_dictionaries({"model": st.one_of(valid_models, json_values)}, optional={"messages": json_values}),
    ))
    raw = json.dumps(value, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    how = draw(st.sampled_from(["as-is", "truncate", "insert", "latin1", "bom", "pad"]))
    if how == "truncate" and raw:
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif how == "insert":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.binary(min_size=1, max_size=4)) + raw[at:]
    elif how == "latin1":
        raw = json.dumps(value, ensure_ascii=False).encode("latin-1", "replace")
    elif how == "bom":
        raw = b"\xef\xbb\xbf" + raw
    elif how == "pad":
        raw = draw(st.sampled_from([b" ", b"\n", b"\t\r\n "])) + raw + b"\n"
    return raw


def _must_be_rejection(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except Rejection as rejection:
        assert 400 <= rejection.status < 500
        assert rejection.message and rejection.code
        body = rejection.body()["error"]
        assert body["message"] == rejection.message and body["type"] and body["code"]
        return rejection


# ---------------------------------------------------------------- parse_body


@SETTINGS
@given(st.one_of(st.binary(max_size=300), st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
                 mutated_json()))
@example(b"")
@example(b"   ")
@example(b"\xff")
@example(b"[" * 100_000)
@example(b'{"model": "m", "model": 7}')
@example(b'{"model": NaN}')
@example(b'{"model": "\\ud800"}')
def test_parse_body_raises_only_rejections(body: bytes) -> None:
    result = _must_be_rejection(parse_body, body)
    if isinstance(result, Rejection):
        assert isinstance(result, BadRequest)
        return
    assert isinstance(result, dict)
    model = result["model"]
    assert isinstance(model, str) and 1 <= len(model) <= 256 and not CONTROL.search(model)


@SETTINGS
# `stream` and `stream_options` must be booleans / an object (gateway/request.check_stream, its own tests).
@given(model=valid_models, extra=st.dictionaries(
           st.text(max_size=10).filter(lambda k: k not in ("model", "stream", "stream_options")), json_values,
           max_size=5),
       ensure_ascii=st.booleans(), indent=st.sampled_from([None, 0, 2]))
def test_parse_body_accepts_every_request_with_a_valid_model(
    model: str, extra: dict[str, Any], ensure_ascii: bool, indent: int | None
) -> None:
    payload = {**extra, "model": model}
    body = json.dumps(payload, ensure_ascii=ensure_ascii, indent=indent).encode()
    assert parse_body(body) == payload


@SETTINGS
@given(model=st.one_of(
    json_values.filter(lambda v: not isinstance(v, str) and v is not None),
    st.text(min_size=257, max_size=400),
    st.text(max_size=20).flatmap(
        lambda t: st.tuples(st.integers(0, len(t)), st.sampled_from([chr(c) for c in [*range(0x20), 0x7F]])).map(
            lambda p: t[: p[0]] + p[1] + t[p[0]:])),
    st.just(""),
))
def test_parse_body_rejects_a_bad_model_as_invalid_model(model: Any) -> None:
    with pytest.raises(BadRequest) as info:
        parse_body(json.dumps({"model": model}).encode())
    assert info.value.code == "invalid_model"


@SETTINGS
@given(st.one_of(st.dictionaries(st.text(max_size=5).filter(lambda k: k != "model"), json_values, max_size=3),
                 st.fixed_dictionaries({"model": st.none()})))
def test_parse_body_without_a_model_is_missing_model(payload: dict[str, Any]) -> None:
    with pytest.raises(BadRequest) as info:
        parse_body(json.dumps(payload).encode())
    assert info.value.code == "missing_model"


# ---------------------------------------------------------------- bearer_key

key_chars = st.characters(blacklist_categories=("Cs",))
keys = st.text(key_chars, min_size=1, max_size=80).filter(lambda k: k.strip() == k and k != "")
header_values = st.one_of(
    st.text(max_size=60),
    keys.map(lambda k: f"Bearer {k}"),
    st.sampled_from(["", " ", "Bearer", "Bearer ", "bearer  x", "Basic dXNlcjpwYXNz", "Bearer\tk", "Token k"]),
)


@SETTINGS
@given(st.lists(header_values, max_size=4).map(tuple))
@example(())
@example(("",))
@example(("Bearer k", "Bearer k"))
def test_bearer_key_raises_only_unauthorized(values: tuple[str, ...]) -> None:
    result = _must_be_rejection(bearer_key, values)
    if isinstance(result, Rejection):
        assert isinstance(result, Unauthorized) and result.status == 401
        assert result.code in ("missing_api_key", "invalid_authorization")
        return
    # Only ever from exactly one header, and never empty or padded.
    assert len(values) == 1
    assert result and result == result.strip()
    assert values[0].strip().lower().startswith("bearer ")


@SETTINGS
@given(key=keys, scheme=st.sampled_from(["Bearer", "bearer", "BEARER", "bEaReR"]),
       before=st.sampled_from(["", " ", "\t"]), between=st.sampled_from([" ", "  ", " \t"]),
       after=st.sampled_from(["", " ", "\t "]))
def test_bearer_key_accepts_every_single_bearer_header(key: str, scheme: str, before: str, between: str,
                                                       after: str) -> None:
    assert bearer_key((f"{before}{scheme}{between}{key}{after}",)) == key


@SETTINGS
@given(st.lists(keys.map(lambda k: f"Bearer {k}"), min_size=2, max_size=4).map(tuple))
def test_bearer_key_refuses_several_headers_even_if_each_is_valid(values: tuple[str, ...]) -> None:
    with pytest.raises(Unauthorized) as info:
        bearer_key(values)
    assert info.value.code == "invalid_authorization"


# ---------------------------------------------------------------- read_head


KNOWN_HEADERS = [":method", ":path", ":authority", ":scheme", "authorization", "content-length", "x-request-id",
                 "content-type", "Authorization", "CONTENT-LENGTH"]
header_names = st.one_of(st.sampled_from(KNOWN_HEADERS), st.text(max_size=20))
any_value = st.one_of(
    st.text(max_size=40),
    st.integers(min_value=0, max_value=10**25).map(str),
    st.sampled_from(["POST", "GET", "/v1/chat/completions", "/v1/completions?x=1", "?", "", "-1", "1e3", " 12",
                     "0x10", "12 ", "Bearer k"]),
)


@SETTINGS
@given(st.lists(st.tuples(header_names, any_value), max_size=12))
def test_read_head_raises_nothing_on_any_header_list(headers: list[tuple[str, str]]) -> None:
    head = _must_be_rejection(read_head, headers)
    assert isinstance(head, RequestHead)
    # The last value of a single-valued header wins; authorization keeps every value in order.
    last = {k: v for k, v in headers}
    assert head.method == last.get(":method", "")
    assert head.path == last.get(":path", "").split("?", 1)[0]
    assert head.request_id == last.get("x-request-id", "")
    assert head.authorization == tuple(v for k, v in headers if k == "authorization")
    cl = last.get("content-length")
    assert head.content_length == (int(cl) if cl is not None and cl.isascii() and cl.isdigit() else None)
    assert head.content_length is None or head.content_length >= 0


@SETTINGS
@given(
    method=st.sampled_from(["POST", "GET", "PUT", "DELETE"]),
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/models", "/"]),
    query=st.one_of(st.just(""), st.text(string.ascii_letters + "=&?", max_size=10).map(lambda q: "?" + q)),
    auth=st.lists(header_values, max_size=3),
    length=st.one_of(st.none(), st.integers(min_value=0, max_value=2**63)),
    request_id=st.uuids().map(str),
    noise=st.lists(st.tuples(st.text(string.ascii_lowercase + "-", min_size=1, max_size=12).filter(
        lambda k: k not in ("authorization", "content-length", "x-request-id")), st.text(max_size=20)), max_size=4),
    order=st.randoms(use_true_random=False),
)
def test_read_head_reads_every_valid_request(method: str, path: str, query: str, auth: list[str], length: int | None,
                                             request_id: str, noise: list[tuple[str, str]], order: Any) -> None:
    headers = [(":method", method), (":path", path + query), ("x-request-id", request_id), *noise]
    if length is not None:
        headers.append(("content-length", str(length)))
    order.shuffle(headers)
    # Authorization values keep their relative order wherever they land.
    at = 0
    for value in auth:
        at = order.randint(at, len(headers))
        headers.insert(at, ("authorization", value))
        at += 1
    head = read_head(headers)
    assert head == RequestHead(method, path, tuple(auth), length, request_id)


# ---------------------------------------------------------------- head_from_attributes

ATTRIBUTE_NAMES = ["request.method", "request.path", "request.id", "request.headers['authorization']"]


@SETTINGS
@given(st.dictionaries(st.one_of(st.sampled_from(ATTRIBUTE_NAMES), st.text(max_size=12)), any_value, max_size=6))
def test_head_from_attributes_raises_nothing(attributes: dict[str, str]) -> None:
    head = _must_be_rejection(head_from_attributes, attributes)
    assert isinstance(head, RequestHead)
    assert head.method == attributes.get("request.method", "")
    assert head.path == attributes.get("request.path", "").split("?", 1)[0]
    auth = attributes.get("request.headers['authorization']")
    assert head.authorization == (tuple(auth.split(",")) if auth is not None else ())


@SETTINGS
# A bearer token (RFC 6750 b64token) has no comma, so a joined value is unambiguous.
@given(auth=st.lists(keys.filter(lambda k: "," not in k).map(lambda k: f"Bearer {k}"), min_size=1, max_size=3))
def test_joined_authorization_headers_are_refused_unless_single(auth: list[str]) -> None:
    # Envoy joins repeated headers with ","; exactly one header is accepted.
    head = head_from_attributes({"request.headers['authorization']": ",".join(auth)})
    result = _must_be_rejection(bearer_key, head.authorization)
    if len(auth) == 1:
        assert result == auth[0].removeprefix("Bearer ").strip()
    else:
        assert isinstance(result, Unauthorized) and result.code == "invalid_authorization"


# ---------------------------------------------------------------- known bugs (see the module docstring)


def test_read_head_content_length_with_a_non_ascii_digit() -> None:
    head = _must_be_rejection(read_head, [("content-length", "²")])
    # Read as no length at all (Envoy enforces the body limit itself), not an error nor the digit 2.
    assert isinstance(head, RequestHead) and head.content_length is None


def test_read_head_content_length_over_4300_digits() -> None:
    head = _must_be_rejection(read_head, [("content-length", "9" * 5000)])
    # Too many digits to convert: read as a length over any limit, so a length check refuses it (413).
    assert isinstance(head, RequestHead) and head.content_length is not None
    with pytest.raises(PayloadTooLarge):
        check_length(head.content_length, 1 << 40)


def test_parse_body_with_an_integer_over_4300_digits() -> None:
    result = _must_be_rejection(parse_body, b'{"model": "m", "n": ' + b"9" * 5000 + b"}")
    assert isinstance(result, BadRequest)


@pytest.mark.parametrize("body", [b'{"model": "a", "model": "b"}', b'{"model": "a", "x": 1, "x": 2}',
                                  b'{"model": "a", "model": "a"}'])
def test_parse_body_refuses_a_top_level_key_given_twice(body: bytes) -> None:
    """Parsers disagree on which value wins; the gateway must not authorize one `model` and send another."""
    result = _must_be_rejection(parse_body, body)
    assert isinstance(result, BadRequest) and result.code == "duplicate_key"
    assert "`model`" in result.message or "`x`" in result.message


def test_parse_body_keeps_nested_objects_as_sent() -> None:
    assert parse_body(b'{"model": "a", "x": {"k": 1, "k": 2}}') == {"model": "a", "x": {"k": 2}}
