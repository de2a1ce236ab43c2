"""What every answer, count and outcome must satisfy (docstring of test_flow_fuzz.py)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import json_format, message

from modeldock.extproc.flow import RequestFlow
from modeldock.gateway import Gateway
from modeldock.types import Endpoint
from tests.support.extproc_messages import ATTR, AUTH
from tests.unit.extproc.flow_fuzz_setup import (
    COMPLETIONS,
    DURATION,
    ENDPOINTS,
    ERROR_TYPES,
    FREE_KEY,
    KEY,
    LIMIT,
    RATELIMIT_HEADERS,
    STATUSES,
    TENANT_OF,
    TENANTS,
    VISIBLE,
)
from tests.unit.extproc.flow_fuzz_strategies import Expected, rejected

# ---------------------------------------------------------------- invariants


def attrs_of(msg: ep.ProcessingRequest) -> dict[str, str]:
    """The string attributes Envoy sent under ext_proc's namespace."""
    if ATTR not in msg.attributes:
        return {}
    return {k: v.string_value for k, v in msg.attributes[ATTR].fields.items() if v.WhichOneof("kind") == "string_value"}


def header_pairs(msg: ep.ProcessingRequest) -> list[tuple[str, bytes]]:
    return [(h.key, h.raw_value or h.value.encode()) for h in msg.request_headers.headers.headers]


def keys_only_in_authorization(messages: list[ep.ProcessingRequest]) -> bool:
    """True unless a key also appears where an answer may echo it back to the same client: the path
    (attribute or header) or the body (error messages name the path and the model; an alias rewrite
    sends the body back)."""
    for msg in messages:
        echoable = [msg.request_body.body, attrs_of(msg).get("request.path", "").encode()]
        echoable += [value for key, value in header_pairs(msg) if key == ":path"]
        if any(k.encode() in part for k in (KEY, FREE_KEY) for part in echoable):
            return False
    return True


def _mutation_ok(mutation: ep.HeaderMutation) -> None:
    for option in mutation.set_headers:
        key, raw = option.header.key, option.header.raw_value or option.header.value.encode()
        assert key == key.lower() and key != "authorization", key
        assert not any(c in raw for c in b"\r\n\x00"), (key, raw)


def changes_nothing(msg: message.Message) -> bool:
    """Every field set is a message that sets nothing in turn (an empty CommonResponse is still a field)."""
    return all(isinstance(value, message.Message) and changes_nothing(value) for _, value in msg.ListFields())


def tenant_of(authorization: str) -> str | None:
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
    attrs = attrs_of(request)
    assert attrs.get("request.method") == "POST", attrs
    assert attrs.get("request.path", "").split("?", 1)[0] in COMPLETIONS, attrs
    tenant = tenant_of(attrs.get(AUTH, ""))
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
    # Envoy's access log prints the tenant; the rid (the servicer's key, none for a bare flow) is never the client's id.
    assert route.pop("tenant") == tenant, route
    rid = route.pop("rid", None)
    assert rid is None or (rid and rid != request_id_of(request)), rid
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


def rid_of(resp: ep.ProcessingResponse) -> str:
    """The key ext_proc gave a routed request (modeldock:rid), which Envoy's retry reports name."""
    return resp.dynamic_metadata.fields["modeldock"].struct_value.fields["rid"].string_value


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
        pairs = header_pairs(request)
        assert dict(pairs).get(":method") == b"GET"
        assert dict(pairs)[":path"].split(b"?")[0] == b"/v1/models"
        auths = [v.decode("utf-8", "surrogateescape") for k, v in pairs if k == "authorization"]
        assert len(auths) == 1 and (tenant := tenant_of(auths[0])) is not None, auths
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
    assert [f.name for f, _ in resp.ListFields()] == [kind] and changes_nothing(getattr(resp, kind)), resp
    return kind


def check_expected(expected: Expected, resp: ep.ProcessingResponse, mode: str) -> None:
    """The first answer of a plausible request is the one its fault calls for."""
    if expected is None:
        return
    if expected[0] == "routed" and expected[1] == "acme" and mode in ("down-closed", "garbage"):
        expected = rejected(503, "rate_limiter_unavailable")  # acme has windows, so Redis is asked
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
    # Metric labels: configured names or empty, whatever the client sent (the series stay bounded).
    assert flow.tenant_id in ("", *TENANTS) and flow.model_name in ("", *VISIBLE["free"]), (flow.tenant_id,
                                                                                          flow.model_name)
    if flow.routed is not None:
        assert (flow.tenant_id, flow.model_name) == (flow.routed.tenant.id, flow.routed.model)
    elif flow.outcome == "models":
        assert flow.tenant_id and not flow.model_name
    elif flow.outcome == "rejected" and flow.status == 401:
        assert (flow.tenant_id, flow.model_name) == ("", "")


@dataclass
class Counted:
    """Where a live routed request must be counted: its primary until Envoy reports a retry elsewhere."""

    primary: Endpoint
    at: Endpoint


def moved(at: Endpoint, address: str, model: str | None) -> Endpoint:
    """Where a request counted `at` is after a retry report naming `address` (a malformed one, or one
    that is not an endpoint of the request's model, is ignored)."""
    try:
        target = Endpoint.parse(address)
    except ValueError:
        return at
    return target if target in {Endpoint.parse(e) for e in ENDPOINTS.get(model or "", ())} else at


def model_serving(primary: Endpoint) -> str | None:
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
    where.at = moved(where.at, address, flow.model)
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


def add_retry_targets(gw: Gateway, model: str, *addresses: str) -> None:
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

async def until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def request_id_of(msg: ep.ProcessingRequest) -> str:
    """The id ext_proc reads from a message: a missing or non-string attribute reads as none."""
    return attrs_of(msg).get("request.id", "")
