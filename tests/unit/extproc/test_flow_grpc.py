"""The ext_proc fuzz and edge cases through the real grpc.aio servicer, in process."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager
from typing import Any, TypeVar, cast

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import message
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from modeldock.extproc.flow import RequestFlow
from modeldock.extproc.server import ExtProcServicer
from modeldock.extproc.wire import add_servicer
from modeldock.gateway import Gateway
from modeldock.gateway.lifecycle import Lifecycle, NoHooks, Outcome
from modeldock.types import Endpoint
from tests.support.extproc_messages import ATTR, AUTH
from tests.unit.extproc.flow_fuzz_invariants import (
    Counted,
    add_retry_targets,
    assert_counts,
    assert_nothing_held,
    attrs_of,
    changes_nothing,
    check_outcome,
    check_response,
    check_routed,
    keys_only_in_authorization,
    model_serving,
    moved,
    primary_of,
    request_id_of,
    rid_of,
    tenant_of,
    until,
)
from tests.unit.extproc.flow_fuzz_setup import (
    FREE_KEY,
    KEY,
    REDIS_MODES,
    FakeRedis,
    body_msg,
    corrupt,
    decoded,
    make_gateway,
    reply_msg,
    seeds,
)
from tests.unit.extproc.flow_fuzz_strategies import reports, wire_script

# ---------------------------------------------------------------- through the real grpc.aio servicer


PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"

# The most any one await of a stream (a write, a read, the status, a server stop) may take. A servicer
# that never answers, or a queue that never lets a request go, fails an assertion in seconds instead of
# hanging the test until pytest's timeout (whose alarm may land in the servicer's task, not the test's).
STEP = 5.0
MAX_FAILURES = 20  # error records kept: a servicer failing in a loop must not grow the test without bound

T = TypeVar("T")


async def within(aw: Awaitable[T], what: str) -> T:
    try:
        async with asyncio.timeout(STEP):
            return await aw
    except TimeoutError:
        raise AssertionError(f"{what}: nothing within {STEP:g} s") from None


class Stream:
    """One Process call whose every await is bounded by STEP."""

    def __init__(self, call: Any) -> None:
        self.call = call

    async def write(self, msg: Any) -> None:
        await within(self.call.write(msg), "the servicer did not take a message")

    async def read(self) -> Any:
        return await within(self.call.read(), "the servicer did not answer")

    async def done_writing(self) -> None:
        await within(self.call.done_writing(), "done_writing")

    async def code(self) -> grpc.StatusCode:
        return await within(self.call.code(), "the stream's status")

    async def details(self) -> str:
        return await within(self.call.details(), "the stream's details")

    def cancel(self) -> bool:
        return bool(self.call.cancel())

    async def close_ok(self) -> None:
        """Done writing; the server ends the stream (EOF, then OK) without another message."""
        await self.done_writing()
        assert await self.read() is grpc.aio.EOF
        assert await self.code() == grpc.StatusCode.OK


@asynccontextmanager
async def channel_to(port: int) -> AsyncIterator[grpc.aio.Channel]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield channel
    finally:
        await within(channel.close(), "closing the channel")


async def settled(predicate: Callable[[], bool]) -> None:
    """Wait for the servicer's state to catch up, at most STEP (a count it never updates fails here)."""
    await until(predicate, timeout=STEP)


async def stop(server: grpc.aio.Server) -> None:
    await within(server.stop(0), "stopping the server")


class Failures(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            self.count += 1
            if len(self.records) < MAX_FAILURES:
                self.records.append(record)


async def serve(gw: Gateway, on_retry: Callable[[RequestFlow], None] | None = None,
                 ) -> tuple[grpc.aio.Server, ExtProcServicer, int, list[RequestFlow]]:
    finished: list[RequestFlow] = []

    class Hooks(NoHooks):
        def on_finished(self, request: Outcome, seconds: float) -> None:
            finished.append(cast(RequestFlow, request))

        def on_retried(self, request: Outcome) -> None:
            if on_retry is not None:
                on_retry(cast(RequestFlow, request))

    servicer = ExtProcServicer(gw, Lifecycle(gw, Hooks()))
    server = grpc.aio.server()
    add_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await within(server.start(), "starting the server")
    return server, servicer, port, finished


def raw_process(channel: grpc.aio.Channel) -> Stream:
    """A Process stream sending bytes as they are: lets a test put invalid UTF-8 on the wire."""
    return Stream(channel.stream_stream(PROCESS, request_serializer=lambda b: b,
                                        response_deserializer=ep.ProcessingResponse.FromString)())


# No shrinking: on a broken servicer each of its hundreds of tries waits out a STEP or floods the client
# (minutes and gigabytes); the first failing example is reported as drawn.
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=(Phase.explicit, Phase.reuse, Phase.generate), report_multiple_bugs=False)
@given(mode=st.sampled_from(REDIS_MODES), seed=seeds, scripts=st.lists(wire_script(), min_size=1, max_size=4),
       data=st.data())
def test_grpc_servicer_streams(mode: str, seed: int, scripts: list[list[tuple[bytes, ep.ProcessingRequest]]],
                               data: st.DataObject) -> None:
    """Streams through the real servicer, their steps interleaved at random, each ended by the client (done
    writing, or cancelled, early or not), with retry reports in between, by the key ext_proc gave a request
    (modeldock:rid) or by a client's x-request-id. A report reaches the live request ext_proc keyed so, and
    nothing else: not a request whose stream ended, never by the client's id (two requests may share it); and
    one request's end never unregisters another's key."""
    # One step per message plus one to end the stream, in a random interleaving.
    steps = data.draw(st.permutations([i for i, script in enumerate(scripts) for _ in range(len(script) + 1)]))
    client_ids = {request_id_of(seen) for script in scripts for _, seen in script} | {"r-unknown"}
    rids: list[str] = [""] * len(scripts)  # the key ext_proc gave each routed stream
    failures = Failures()
    logger = logging.getLogger("modeldock.extproc")
    logger.addHandler(failures)

    async def run() -> None:
        gw = make_gateway(mode, seed=seed)
        reached: list[RequestFlow] = []  # the flows retry reports moved, by the servicer's on_retry
        server, servicer, port, finished = await serve(gw, reached.append)
        calls: list[Stream | None] = [None] * len(scripts)
        secret = [keys_only_in_authorization([seen for _, seen in script]) for script in scripts]
        firsts: list[ep.ProcessingResponse | None] = [None] * len(scripts)
        request_ids = [""] * len(scripts)
        registry: dict[str, int] = {}  # what the servicer should route reports by: rid -> stream
        counted: dict[Hashable, Counted] = {}
        sent = [0] * len(scripts)
        answered = [False] * len(scripts)  # an immediate response: Envoy sends nothing more
        ended = [False] * len(scripts)

        def report(request_id: str, address: str) -> None:
            target = registry.get(request_id)
            reached.clear()
            servicer.lifecycle.retried(request_id, address)
            if target is None:
                assert not reached, f"a report for {request_id!r} reached {reached}"
                return
            before = counted[target].at
            counted[target].at = moved(before, address, model_serving(counted[target].primary))
            if counted[target].at == before:
                assert not reached, "on_retry for a report that moved nothing"  # counted once, as a real move
                return
            assert len(reached) == 1 and reached[0].rid == request_id
            flow = reached[0]
            assert flow.lease is not None and not flow.lease.released and flow.lease.endpoint == counted[target].at

        try:
            async with channel_to(port) as channel:
                for i in steps:
                    for address in data.draw(reports):
                        report(data.draw(st.sampled_from(sorted(client_ids | {r for r in rids if r}))), address)
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
                            await call.close_ok()
                        ended[i] = True
                        # The servicer ends every flow when its stream ends, cancelled or not (in the same step
                        # as it counts the stream closed: waiting on the count fails fast if it does not).
                        await settled(lambda: servicer.open_streams == sum(c is not None for c in calls) - sum(ended))
                        assert len(finished) == sum(ended)
                        flow = finished[-1]
                        check_outcome(flow, firsts[i])
                        if i in counted:
                            assert flow.head is not None and flow.head.request_id == request_ids[i]
                            del counted[i]
                        if rids[i]:
                            assert registry.pop(rids[i]) == i
                    else:
                        if call is None:
                            call = calls[i] = raw_process(channel)
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
                                request_ids[i] = request_id_of(seen)
                                rids[i] = rid_of(resp)  # the servicer registered it before answering
                                assert rids[i] and rids[i] not in rids[:i] + rids[i + 1:], rids
                                registry[rids[i]] = i
                        sent[i] += 1
                    assert_counts(gw, counted)
                    assert servicer.open_streams == sum(c is not None for c in calls) - sum(ended)
                    routed_acme = sum(
                        1 for j in counted if tenant_of(attrs_of(scripts[j][0][1]).get(AUTH, "")) == "acme"
                    )
                    assert routed_acme <= gw.admission.in_flight("acme") <= 1
            assert all(ended) and servicer.open_streams == 0
            for request_id in sorted(client_ids | set(rids)):  # every stream ended: no report reaches anything
                report(request_id, "10.0.0.9:8000")
            assert_nothing_held(gw)
        finally:
            await stop(server)
            await within(gw.admission.close(), "closing admission")

    try:
        asyncio.run(run())
    finally:
        logger.removeHandler(failures)
    assert not failures.count, (failures.count, [r.getMessage() for r in failures.records])


@pytest.mark.parametrize("junk", [b"\xff\xfe\xfd\xfc", b"Bearer \xff\xfe" + KEY.encode(),
                                  b"Bearer " + KEY.encode() + b"\xc3", b"\xed\xa0\x80" * 3])
async def test_grpc_authorization_attribute_not_utf8_gets_401(junk: bytes) -> None:
    """Envoy copies the Authorization header's bytes into a protobuf string; bytes that are not UTF-8 must be
    an unknown key (401 JSON), not a grpc error that breaks the request."""
    gw = make_gateway()
    server, servicer, port, finished = await serve(gw)
    failures = Failures()
    logging.getLogger("modeldock.extproc").addHandler(failures)
    try:
        raw = corrupt(body_msg(b'{"model":"llama-8b"}'), {(ATTR, AUTH): junk})
        with pytest.raises(message.DecodeError):  # what upb alone would do with it
            ep.ProcessingRequest.FromString(raw)
        async with channel_to(port) as channel:
            call = raw_process(channel)
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
            await call.close_ok()
            await settled(lambda: servicer.open_streams == 0 and len(finished) == 1)
        assert finished[0].outcome == "rejected" and finished[0].status == 401
        assert_nothing_held(gw)
    finally:
        logging.getLogger("modeldock.extproc").removeHandler(failures)
        await stop(server)
    assert not failures.count, (failures.count, [r.getMessage() for r in failures.records])


async def test_grpc_other_attribute_not_utf8_is_routed() -> None:
    """Bytes that are not UTF-8 in another attribute (here the request id) do not stop a good request; its
    retries are reported under the key ext_proc gave it, whatever the client's id."""
    gw = make_gateway()
    reached: list[RequestFlow] = []
    server, servicer, port, finished = await serve(gw, reached.append)
    try:
        msg = body_msg(b'{"model":"llama-70b"}', auth=f"Bearer {FREE_KEY}")
        raw = corrupt(msg, {(ATTR, "request.id"): b"\xffid\xfe"})
        async with channel_to(port) as channel:
            call = raw_process(channel)
            await call.write(raw)
            resp = await call.read()
            assert resp is not grpc.aio.EOF, f"stream broken: {await call.code()}"
            assert check_routed(decoded(msg, {(ATTR, "request.id"): b"\xffid\xfe"}), resp) == "llama-70b"
            rid = rid_of(resp)
            assert gw.picker.in_flight(Endpoint.parse("10.0.0.3:8000")) == gw.picker.total_in_flight() == 1
            add_retry_targets(gw, "llama-70b", "10.0.0.9:8000")  # a lease only moves within its model
            for client_id in ("r-1", "\ufffdid\ufffd"):  # the client's id, as sent or as read, keys nothing
                servicer.lifecycle.retried(client_id, "10.0.0.9:8000")
            assert not reached and gw.picker.in_flight(Endpoint.parse("10.0.0.3:8000")) == 1
            servicer.lifecycle.retried(rid, "10.0.0.9:8000")
            assert len(reached) == 1 and reached[0].retried
            assert gw.picker.in_flight(Endpoint.parse("10.0.0.9:8000")) == gw.picker.total_in_flight() == 1
            # A later message with bad bytes (Envoy sends none) goes on unchanged.
            stray = corrupt(reply_msg("200"), {(ATTR, "request.path"): b"/v1/\xff\xff"})
            await call.write(stray)
            later = await call.read()
            assert later.WhichOneof("response") == "response_headers" and changes_nothing(later), later
            await call.close_ok()
            await settled(lambda: servicer.open_streams == 0 and len(finished) == 1)
        assert finished[0].outcome == "proxied" and finished[0].head.request_id == "\ufffdid\ufffd"
        assert_nothing_held(gw)
        servicer.lifecycle.retried(rid, "10.0.0.3:8000")  # the stream ended
        assert len(reached) == 1
        assert_nothing_held(gw)
    finally:
        await stop(server)


async def test_grpc_requests_sharing_a_client_id_keep_their_own_reports() -> None:
    """A client may send its own x-request-id, so two live requests can share one. ext_proc keys each on its
    own rid: a retry report lands on the request it names, and the end of one keeps the other's entry."""
    gw = make_gateway()
    reached: list[RequestFlow] = []
    server, servicer, port, finished = await serve(gw, reached.append)
    try:
        async with channel_to(port) as channel:
            calls = [raw_process(channel) for _ in range(2)]
            rids = []
            for call in calls:  # free has no limits: both are routed
                await call.write(body_msg(b'{"model":"llama-70b"}', auth=f"Bearer {FREE_KEY}",
                                          request_id="dup").SerializeToString())
                resp = await call.read()
                assert resp.WhichOneof("response") == "request_body"
                rids.append(rid_of(resp))
            assert len(set(rids)) == 2 and "dup" not in rids
            assert gw.picker.in_flight(Endpoint.parse("10.0.0.3:8000")) == 2
            add_retry_targets(gw, "llama-70b", "10.0.0.9:8000", "[::1]:8000")  # a lease only moves within its model
            servicer.lifecycle.retried("dup", "10.0.0.9:8000")  # the client's id names no request
            assert not reached
            servicer.lifecycle.retried(rids[0], "10.0.0.9:8000")
            first = reached[-1]
            assert first.rid == rids[0] and gw.picker.in_flight(Endpoint.parse("10.0.0.9:8000")) == 1
            servicer.lifecycle.retried(rids[1], "[::1]:8000")
            second = reached[-1]
            assert second.rid == rids[1] and second is not first
            assert gw.picker.in_flight(Endpoint.parse("[::1]:8000")) == 1
            await calls[0].close_ok()
            await settled(lambda: len(finished) == 1)
            assert finished[0] is first
            assert gw.picker.in_flight(Endpoint.parse("10.0.0.9:8000")) == 0
            servicer.lifecycle.retried(rids[0], "10.0.0.3:8000")  # ended: its key is gone
            assert len(reached) == 2
            servicer.lifecycle.retried(rids[1], "10.0.0.3:8000")  # the other's entry survived the first's end
            assert reached[-1] is second and len(reached) == 3
            assert gw.picker.in_flight(Endpoint.parse("10.0.0.3:8000")) == gw.picker.total_in_flight() == 1
            calls[1].cancel()
            await settled(lambda: servicer.open_streams == 0 and len(finished) == 2)
            assert finished[1] is second
            servicer.lifecycle.retried(rids[1], "10.0.0.9:8000")
            assert len(reached) == 3
        assert_nothing_held(gw)
    finally:
        await stop(server)


async def test_grpc_client_gone_while_waiting_for_redis_holds_nothing() -> None:
    redis = FakeRedis("up")
    redis.gate = asyncio.Event()
    gw = make_gateway("up", redis)
    server, servicer, port, finished = await serve(gw)
    try:
        async with channel_to(port) as channel:
            call = Stream(ep_grpc.ExternalProcessorStub(channel).Process())
            await call.write(body_msg(b'{"model":"llama-8b"}'))
            await settled(lambda: gw.admission.in_flight("acme") == 1)
            call.cancel()
            await settled(lambda: servicer.open_streams == 0 and len(finished) == 1)
        assert_nothing_held(gw)
        assert finished[0].lease is None  # never picked: the client left during admission
        assert finished[0].outcome == "incomplete"
        servicer.lifecycle.retried("r-1", "10.0.0.2:8000")  # never routed, so never registered
        assert_nothing_held(gw)
    finally:
        await stop(server)
