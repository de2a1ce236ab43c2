"""Fuzzing the ext_proc state machine with random ProcessingRequest messages.

Envoy's protocol (docs/envoy.md): a completion request arrives as one `request_body` message
carrying the request's method, path, id and Authorization header as attributes; only
`GET /v1/models` sends `request_headers`. Nothing else is ever sent (the response phases are
skipped, and Envoy answers a request without a body itself). When Envoy retries a routed request
onto another endpoint, its access log reports that out of band: `RequestFlow.retried_on(address)`,
or `Lifecycle.retried(request_id, address)` through the servicer's registry.

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

The fuzzing is split along its seams: flow_fuzz_setup.py (the gateway and message helpers),
flow_fuzz_strategies.py, flow_fuzz_invariants.py; this file drives RequestFlow directly,
test_flow_utf8.py and test_flow_grpc.py go through the wire and the real servicer, and
test_flow_regressions.py pins inputs the fuzzer once found (see test_request_properties.py
for the parser side).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import given
from hypothesis import strategies as st

from modeldock.extproc.flow import RequestFlow
from tests.unit.extproc.flow_fuzz_invariants import (
    Counted,
    assert_counts,
    assert_nothing_held,
    check_expected,
    check_outcome,
    check_response,
    keys_only_in_authorization,
    live,
    primary_of,
    report_retry,
    until,
)
from tests.unit.extproc.flow_fuzz_setup import FUZZ, REDIS_MODES, FakeRedis, body_msg, make_gateway, seeds
from tests.unit.extproc.flow_fuzz_strategies import (
    Expected,
    addresses,
    good_request,
    plausible_messages,
    plausible_request,
    random_message,
    reports,
    sequences,
)

# ---------------------------------------------------------------- RequestFlow directly




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
    await until(lambda: gw.admission.in_flight("acme") == 1)  # the slot is taken while Redis is asked
    assert not task.done() and gw.picker.total_in_flight() == 0  # nothing picked before admission
    task.cancel()  # Envoy's stream ended: the client left
    with pytest.raises(asyncio.CancelledError):
        await task
    flow.finish()
    assert_nothing_held(gw)
