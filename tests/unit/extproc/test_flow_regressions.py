"""Inputs the fuzzer once found, pinned (see test_request_properties.py for the parser side)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from modeldock.extproc.flow import RequestFlow
from modeldock.types import Endpoint
from tests.support.extproc_messages import AUTH
from tests.unit.extproc.flow_fuzz_invariants import add_retry_targets, assert_nothing_held, check_response
from tests.unit.extproc.flow_fuzz_setup import FREE_KEY, KEY, body_msg, make_gateway, models_msg, reply_msg

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
        add_retry_targets(gw, "llama-8b", before)  # a lease only moves within its model
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
