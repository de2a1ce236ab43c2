"""Parse what ext_proc sees of a request. Pure functions; every failure is a Rejection."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from modeldock.errors import BadRequest, PayloadTooLarge, Unauthorized

# Model names: printable, no control characters, bounded length.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_HUGE = 1 << 62  # stands for any length with too many digits to convert


def ascii_int(value: str) -> int | None:
    """A header's decimal number; None unless it is plain ASCII digits."""
    if not (value.isascii() and value.isdigit()):
        return None
    return int(value) if len(value) <= 4000 else _HUGE


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    # 1e999 reads as infinity, which a rewritten body would send on as `Infinity`.
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


class _Duplicated(dict[str, object]):
    """An object that named a key twice (`key`, the first repeated). JSON parsers disagree on which value
    wins, so a body the gateway authorized on one `model` could reach the backend as another."""

    key = ""


def _object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    data = dict(pairs)
    if len(data) == len(pairs):
        return data
    seen: set[str] = set()
    duplicated = _Duplicated(data)
    duplicated.key = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
    return duplicated


# One decoder for every request: json.loads with hooks builds a new one each call.
_DECODER = json.JSONDecoder(parse_constant=_no_constants, parse_float=_finite_float, object_pairs_hook=_object)


@dataclass(frozen=True)
class RequestHead:
    method: str
    path: str  # without the query string
    authorization: tuple[str, ...]
    content_length: int | None
    request_id: str
    priority: str = ""  # the `x-priority` header (PRIORITY_HEADER): a queue class the tenant may ask for


def read_head(headers: Iterable[tuple[str, str]]) -> RequestHead:
    method = path = request_id = ""
    authorization: list[str] = []
    content_length: int | None = None
    for key, value in headers:
        if key == ":method":
            method = value
        elif key == ":path":
            path = value.split("?", 1)[0]
        elif key == "authorization":
            authorization.append(value)
        elif key == "content-length":
            content_length = ascii_int(value)
        elif key == "x-request-id":
            request_id = value
    return RequestHead(method, path, tuple(authorization), content_length, request_id)


PRIORITY_HEADER = "x-priority"
_PRIORITY_ATTRIBUTE = f"request.headers['{PRIORITY_HEADER}']"


def head_from_attributes(attributes: dict[str, str]) -> RequestHead:
    """The request as Envoy's `request_attributes` describe it (no header phase)."""
    path = attributes.get("request.path", "").split("?", 1)[0]
    auth = attributes.get("request.headers['authorization']")
    # Envoy joins repeated headers with ","; a bearer token never contains one.
    authorization = tuple(auth.split(",")) if auth is not None else ()
    return RequestHead(attributes.get("request.method", ""), path, authorization, None,
                       attributes.get("request.id", ""), attributes.get(_PRIORITY_ATTRIBUTE, "").strip())


def bearer_key(authorization: tuple[str, ...]) -> str:
    """The API key from exactly one `Authorization: Bearer <key>` header."""
    if not authorization or (len(authorization) == 1 and not authorization[0].strip()):
        raise Unauthorized("Missing API key. Send it as `Authorization: Bearer <key>`.", code="missing_api_key")
    if len(authorization) > 1:
        raise Unauthorized("Send exactly one Authorization header.", code="invalid_authorization")
    scheme, _, key = authorization[0].strip().partition(" ")
    if scheme.lower() != "bearer":
        raise Unauthorized("Authorization must use the Bearer scheme.", code="invalid_authorization")
    key = key.strip()
    if not key:
        raise Unauthorized("Missing API key. Send it as `Authorization: Bearer <key>`.", code="missing_api_key")
    return key


def check_length(length: int, limit: int) -> None:
    if length > limit:
        raise PayloadTooLarge(f"Request body is {length} bytes; the limit is {limit} bytes.")


def parse_body(body: bytes) -> dict[str, object]:
    """The JSON object of a completion request, with a valid `model`."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("Request body is not valid UTF-8.", code="invalid_body") from None
    if not text.strip():
        raise BadRequest("Request body is empty; send a JSON object with a `model`.", code="invalid_body")
    try:
        # ValueError also covers integers past Python's digit limit, NaN/Infinity and
        # numbers past a double's range.
        data = _DECODER.decode(text)
    except (ValueError, RecursionError):
        raise BadRequest("Request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest("Request body must be a JSON object.", code="invalid_body")
    if type(data) is _Duplicated:  # only the top level: nested objects go upstream as they are
        raise BadRequest(f"Request body has the key `{data.key[:64]}` more than once.", code="duplicate_key")
    model = data.get("model")
    if model is None:
        raise BadRequest("Request body has no `model`.", code="missing_model")
    if not isinstance(model, str):
        raise BadRequest("`model` must be a string.", code="invalid_model")
    if not model or len(model) > 256 or _CONTROL.search(model):
        raise BadRequest("`model` must be 1-256 printable characters.", code="invalid_model")
    check_stream(data)
    return data


def check_stream(data: dict[str, object]) -> None:
    """`stream` and `stream_options.include_usage` are JSON booleans. A backend that parses leniently (vLLM
    reads "true" and 1 as true) would stream a request the gateway took for a plain one, without the usage
    the gateway asked for."""
    stream = data.get("stream")
    if stream is not None and type(stream) is not bool:
        raise BadRequest("`stream` must be true or false.", code="invalid_value", param="stream")
    options = data.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise BadRequest("`stream_options` must be an object.", code="invalid_value", param="stream_options")
    include = options.get("include_usage")
    if include is not None and type(include) is not bool:
        raise BadRequest("`stream_options.include_usage` must be true or false.", code="invalid_value",
                         param="stream_options.include_usage")
