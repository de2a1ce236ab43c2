"""Fuzzing the ext_proc state machine with random ProcessingRequest messages.

Random phase kinds in random order, random headers (raw and string values, arbitrary bytes),
random bodies and attributes, and valid request prefixes followed by garbage, sent to
`RequestFlow` directly (one flow, and several flows interleaved with early finishes) and through
the real grpc.aio servicer in process. Invariants:

- every answer is a ProcessingResponse of a kind allowed for the message it answers;
- no exception escapes (only a task cancellation may, and that holds nothing either);
- rejections are OpenAI-style JSON; no header we set carries CR, LF or NUL; secrets are stripped;
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
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import ConnectionError as RedisConnectionError

from modeldock.admission.limits import Admission
from modeldock.clock import FakeClock
from modeldock.config import hash_key, parse_config
from modeldock.discovery.snapshot import Endpoint
from modeldock.extproc.flow import STRIPPED, RequestFlow
from modeldock.extproc.gateway import Gateway
from modeldock.extproc.server import ExtProcServicer
from modeldock.picking import Picker

KEY, FREE_KEY = "k-fuzz-acme", "k-fuzz-free"
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
REDIS_MODES = ["none", "up", "down-closed", "down-open", "garbage"]
STATUSES = {200, 400, 401, 403, 404, 413, 429, 503}
KINDS = ["request_headers", "request_body", "response_headers", "response_body", "request_trailers",
         "response_trailers"]
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


# ---------------------------------------------------------------- strategies


def _decoded(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")  # as flow._headers reads raw_value


header_keys = st.one_of(
    st.sampled_from([":method", ":path", "authorization", "content-length", "x-request-id", ":status", ":authority",
                     "x-gateway-destination-endpoint", "x-modeldock-cluster", "content-type", "Authorization"]),
    st.text(max_size=12),
)
text_values = st.one_of(
    st.sampled_from(["POST", "GET", "PUT", "/v1/chat/completions", "/v1/completions", "/v1/models",
                     "/v1/models?x=1", "/v1/embeddings", f"Bearer {KEY}", f"Bearer {FREE_KEY}", f"bearer  {KEY}",
                     "Bearer ", "Bearer wrong", "Basic eDp5", "", "0", "12", "2049", "99999999999", "200", "503",
                     "abc", "10.0.0.1:8000"]),
    st.text(max_size=30),
)


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


attr_scalars = st.one_of(
    st.sampled_from([*ENDPOINTS["llama-8b"], *ENDPOINTS["llama-70b"], "10.0.0.9:8000", "[::1]:8000", "garbage", "",
                     "10.0.0.1:0", "10.0.0.1:99999", "10.0.0.1:²"]),
    st.text(max_size=20), st.floats(allow_nan=False), st.booleans(), st.none(),
)


@st.composite
def attributes(draw: st.DrawFn) -> dict[str, struct_pb2.Struct]:
    out = {}
    for name in draw(st.lists(st.one_of(st.just("envoy.filters.http.ext_proc"), st.text(max_size=10)), max_size=2)):
        fields = draw(st.dictionaries(st.one_of(st.sampled_from(["upstream.address", "request.id"]),
                                                st.text(max_size=8)),
                                      st.one_of(attr_scalars, st.lists(attr_scalars, max_size=2)), max_size=3))
        s = struct_pb2.Struct()
        s.update(fields)
        out[name] = s
    return out


payloads = st.fixed_dictionaries(
    {"model": st.one_of(st.sampled_from(["llama-8b", "llama-70b", "mistral", "nope", "llama-8b\r\nx: y", ""]),
                        st.integers(-5, 5), st.none())},
    optional={"messages": st.just([{"role": "user", "content": "hi"}]), "stream": st.booleans(),
              "pad": st.sampled_from(["x", "y" * 2100])},
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["json", "json", "json", "truncated", "bytes", "empty", "big", "array"]))
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


def _with_attrs(msg: ep.ProcessingRequest, attrs: dict[str, struct_pb2.Struct]) -> ep.ProcessingRequest:
    for name, value in attrs.items():
        msg.attributes[name].CopyFrom(value)
    return msg


def _headers_msg(field: str, headers: list[base_pb2.HeaderValue], eos: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(**{field: ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers),
                                                         end_of_stream=eos)})


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


@st.composite
def valid_prefix(draw: st.DrawFn) -> list[ep.ProcessingRequest]:
    """What Envoy sends for a good request, cut at a random point."""
    key = draw(st.sampled_from([KEY, FREE_KEY]))
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    headers = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
               [(":method", "POST"), (":path", path), ("x-request-id", "r-1"), ("authorization", f"Bearer {key}")]]
    model = draw(st.sampled_from(["llama-8b", "llama-70b"]))
    served = draw(st.sampled_from([*ENDPOINTS[model], "10.0.0.9:8000", "junk"]))
    status = draw(st.sampled_from(["200", "503", "", "abc"]))
    attrs = struct_pb2.Struct()
    attrs.update({"upstream.address": served})
    resp = _headers_msg("response_headers", [base_pb2.HeaderValue(key=":status", raw_value=status.encode())], False)
    resp.attributes["envoy.filters.http.ext_proc"].CopyFrom(attrs)
    full = [
        _headers_msg("request_headers", headers, False),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=json.dumps({"model": model, "prompt": "x"}).encode(),
                                                      end_of_stream=True)),
        resp,
        ep.ProcessingRequest(response_body=ep.HttpBody(body=b"data: {}\n\n", end_of_stream=True)),
    ]
    return full[: draw(st.integers(0, len(full)))]


@st.composite
def plausible_request(draw: st.DrawFn) -> list[ep.ProcessingRequest]:
    """A good request with at most one part broken (method, path, key, length, end of stream, model, body)."""
    fault = draw(st.sampled_from(["none", "method", "path", "auth", "length", "eos", "model", "body", "models"]))
    method, path = "POST", draw(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/completions?x=1"]))
    auth = [draw(st.sampled_from([f"Bearer {KEY}", f"Bearer {FREE_KEY}"]))]
    length: list[str] = []
    eos = False
    model: Any = draw(st.sampled_from(["llama-8b", "llama-70b"]))
    body: bytes | None = None
    if fault == "method":
        method = draw(st.sampled_from(["GET", "PUT", "", "post"]))
    elif fault == "path":
        path = draw(st.sampled_from(["/v1/embeddings", "/", "", "/v1/chat/completions/x", "v1/completions"]))
    elif fault == "auth":
        auth = draw(st.lists(st.sampled_from([f"Bearer {KEY}", "Bearer nope", "Basic eDp5", "Bearer ", "", KEY]),
                             max_size=3).filter(lambda a: a != [f"Bearer {KEY}"]))
    elif fault == "length":
        length = [draw(st.sampled_from(["2048", "2049", "999999", "x", "-1", ""]))]
    elif fault == "eos":
        eos = True
    elif fault == "model":
        model = draw(st.one_of(st.sampled_from(["mistral", "nope", "", "llama-8b\r\n", "llama-*"]),
                               st.integers(), st.none(), st.lists(st.just("llama-8b"), max_size=1)))
    elif fault == "body":
        body = draw(bodies())
    elif fault == "models":
        method, path, eos = "GET", "/v1/models", True
    pairs = [(":method", method), (":path", path), ("x-request-id", "r-2")]
    pairs += [("authorization", a) for a in auth] + [("content-length", v) for v in length]
    headers = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    headers += draw(st.lists(header_value(), max_size=2))
    if body is None:
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    return [_headers_msg("request_headers", headers, eos),
            ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))]


sequences = st.one_of(
    st.lists(random_message, max_size=8),
    st.builds(lambda p, g: p + g, valid_prefix(), st.lists(random_message, max_size=5)),
    st.builds(lambda p, g: p + g, plausible_request(), st.lists(random_message, max_size=4)),
)


# ---------------------------------------------------------------- invariants


def _mutation_ok(mutation: ep.HeaderMutation) -> None:
    for option in mutation.set_headers:
        key, raw = option.header.key, option.header.raw_value or option.header.value.encode()
        assert key == key.lower() and key != "authorization", key
        assert not any(c in raw for c in b"\r\n\x00"), (key, raw)


def keys_only_in_authorization(messages: list[ep.ProcessingRequest]) -> bool:
    """True unless a key also appears outside an Authorization header (a client may put it in the path or the
    body, and error messages echo those back to that same client)."""
    for msg in messages:
        copy = ep.ProcessingRequest()
        copy.CopyFrom(msg)
        for field in ("request_headers", "response_headers"):
            if copy.HasField(field):
                kept = [h for h in getattr(copy, field).headers.headers if h.key != "authorization"]
                del getattr(copy, field).headers.headers[:]
                getattr(copy, field).headers.headers.extend(kept)
        raw = copy.SerializeToString()
        if KEY.encode() in raw or FREE_KEY.encode() in raw:
            return False
    return True


def check_response(request: ep.ProcessingRequest, resp: ep.ProcessingResponse, first: bool,
                   secret: bool = True) -> str:
    """Assert the answer is well formed for the message; returns its kind. `secret`: the keys were sent only
    as Authorization, so no answer may contain them."""
    assert isinstance(resp, ep.ProcessingResponse)
    assert ep.ProcessingResponse.FromString(resp.SerializeToString()) == resp
    kind = resp.WhichOneof("response")
    asked = request.WhichOneof("request")
    allowed = {asked or "request_headers", "immediate_response"}
    assert kind in allowed, f"{asked} answered with {kind}"
    if kind == "immediate_response":
        imm = resp.immediate_response
        assert imm.status.code in STATUSES, imm.status.code
        assert imm.details.startswith("modeldock_")
        _mutation_ok(imm.headers)
        assert {h.header.key: h.header.raw_value for h in imm.headers.set_headers}["content-type"] == b"application/json"
        payload = json.loads(imm.body)
        if imm.status.code != 200:
            err = payload["error"]
            assert err["message"] and err["type"] and err["code"], err
        if secret:
            assert KEY not in imm.body.decode() and FREE_KEY not in imm.body.decode()
        return kind
    if kind.endswith("trailers"):
        _mutation_ok(getattr(resp, kind).header_mutation)
        return kind
    common = getattr(resp, kind).response
    _mutation_ok(common.header_mutation)
    if kind == "request_headers" and first:
        # The headers phase let a request on: the key and routing headers must not go upstream.
        assert set(STRIPPED) <= set(common.header_mutation.remove_headers)
    if kind == "request_body" and common.header_mutation.set_headers:
        hdrs = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
        cluster = hdrs["x-modeldock-cluster"]
        model = cluster.removeprefix("model:")
        assert set(hdrs["x-gateway-destination-endpoint"].split(",")) <= set(ENDPOINTS[model])
        if common.body_mutation.body:
            assert json.loads(common.body_mutation.body)["model"] == "meta/llama-70b"
    return kind


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
        for i, msg in enumerate(messages):
            check_response(msg, await flow.handle(msg), first=i == 0, secret=secret)
            assert gw.picker.total_in_flight() <= 1 and gw.admission.in_flight("acme") <= 1
        flow.finish()
        assert_nothing_held(gw)
        flow.finish()  # idempotent
        assert_nothing_held(gw)
        await gw.admission.close()

    asyncio.run(run())


@FUZZ
@given(mode=st.sampled_from(REDIS_MODES),
       scripts=st.lists(st.one_of(sequences, plausible_request(), valid_prefix()), min_size=2, max_size=6),
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
    await flow.handle(_headers_msg("request_headers", [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
                                                       [(":method", "POST"), (":path", "/v1/completions"),
                                                        ("authorization", f"Bearer {KEY}")]], False))
    task = asyncio.create_task(flow.handle(ep.ProcessingRequest(request_body=ep.HttpBody(
        body=b'{"model": "llama-8b"}', end_of_stream=True))))
    await asyncio.sleep(0.01)
    assert gw.admission.in_flight("acme") == 1  # the slot is taken while Redis is asked
    task.cancel()  # Envoy's stream ended: the client left
    with pytest.raises(asyncio.CancelledError):
        await task
    flow.finish()
    assert_nothing_held(gw)


# ---------------------------------------------------------------- through the real grpc.aio servicer


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
    ep_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, servicer, port, finished


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(REDIS_MODES), scripts=st.lists(sequences.filter(bool), min_size=1, max_size=4),
       endings=st.lists(st.sampled_from(["done_writing", "cancel"]), min_size=4, max_size=4))
def test_grpc_servicer_streams(mode: str, scripts: list[list[ep.ProcessingRequest]], endings: list[str]) -> None:
    failures = _Failures()
    logger = logging.getLogger("modeldock.extproc")
    logger.addHandler(failures)

    async def one_stream(stub: ep_grpc.ExternalProcessorStub, messages: list[ep.ProcessingRequest],
                         ending: str) -> None:
        call = stub.Process()
        secret = keys_only_in_authorization(messages)
        for i, msg in enumerate(messages):
            await call.write(msg)
            resp = await call.read()
            assert resp is not grpc.aio.EOF, "the server ended the stream instead of answering"
            if check_response(msg, resp, first=i == 0, secret=secret) == "immediate_response":
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
                stub = ep_grpc.ExternalProcessorStub(channel)
                await asyncio.gather(*(one_stream(stub, s, e) for s, e in zip(scripts, endings, strict=False)))
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


async def test_grpc_client_gone_while_waiting_for_redis_holds_nothing() -> None:
    redis = FakeRedis("up")
    redis.gate = asyncio.Event()
    gw = make_gateway("up", redis)
    server, servicer, port, finished = await _serve(gw)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = ep_grpc.ExternalProcessorStub(channel).Process()
            await call.write(_headers_msg("request_headers", [base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                                              for k, v in [(":method", "POST"),
                                                                           (":path", "/v1/completions"),
                                                                           ("authorization", f"Bearer {KEY}")]],
                                          False))
            assert (await call.read()).WhichOneof("response") == "request_headers"
            await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=b'{"model":"llama-8b"}',
                                                                           end_of_stream=True)))
            await _until(lambda: gw.admission.in_flight("acme") == 1)
            call.cancel()
            await _until(lambda: servicer.open_streams == 0 and len(finished) == 1)
        assert_nothing_held(gw)
    finally:
        await server.stop(0)


# ---------------------------------------------------------------- known bugs


async def test_response_status_with_a_non_ascii_digit() -> None:
    gw = make_gateway()
    flow = RequestFlow(gw)
    for msg in valid_prefix_messages()[:2]:
        await flow.handle(msg)
    resp = await flow.handle(_headers_msg("response_headers", [base_pb2.HeaderValue(key=":status", raw_value="²".encode())],
                                          False))
    assert resp.WhichOneof("response") == "response_headers"
    flow.finish()


async def test_request_content_length_with_a_non_ascii_digit() -> None:
    flow = RequestFlow(make_gateway())
    msg = valid_prefix_messages()[0]
    msg.request_headers.headers.headers.append(base_pb2.HeaderValue(key="content-length", raw_value="²".encode()))
    resp = await flow.handle(msg)
    assert resp.WhichOneof("response") in ("request_headers", "immediate_response")


def valid_prefix_messages() -> list[ep.ProcessingRequest]:
    headers = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
               [(":method", "POST"), (":path", "/v1/completions"), ("authorization", f"Bearer {KEY}")]]
    return [_headers_msg("request_headers", headers, False),
            ep.ProcessingRequest(request_body=ep.HttpBody(body=b'{"model":"llama-8b"}', end_of_stream=True))]
