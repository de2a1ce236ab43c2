"""Envoy 1.40 behaviour that modeldock's one-message ext_proc design relies on.

Each test runs the real bootstrap (`render_bootstrap`) with the ADS parts swapped for a
static cluster, a scripted ext_proc servicer and a recording upstream, so a change in
Envoy (or in envoy/bootstrap.yaml) that breaks one of these facts fails here, by name,
before it shows up as a confusing end-to-end failure. See docs/envoy.md.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import json_format, message

from modeldock.config import ModelConfig
from modeldock.envoy import BootstrapOptions, envoy_binary, render_bootstrap
from modeldock.errors import Unauthorized
from modeldock.extproc import responses
from modeldock.extproc.attempts import AttemptLogServicer
from modeldock.extproc.wire import parse_request
from modeldock.up import free_port
from modeldock.xds.resources import build_cluster, cluster_name

pytestmark = pytest.mark.e2e
ATTRS = "envoy.filters.http.ext_proc"
BODY = b'{"model":"m","messages":[]}'


@dataclass
class Seen:
    """One ext_proc stream as the scripted servicer saw it."""
    kinds: list[str] = field(default_factory=list)
    attributes: list[dict[str, Any]] = field(default_factory=list)
    answered_at: list[float] = field(default_factory=list)
    ended_at: float = 0.0
    raw: list[bytes] = field(default_factory=list)
    header_names: list[list[str]] = field(default_factory=list)


# How the scripted servicer answers a body message: (request) -> response.
Answer = Callable[[ep.ProcessingRequest], ep.ProcessingResponse]


class ScriptedExtProc:
    def __init__(self) -> None:
        self.streams: list[Seen] = []
        self.answer: Answer = responses.continue_other
        self.body_delay = 0.0

    async def process(self, requests: AsyncIterator[bytes], _ctx: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        seen = Seen()
        self.streams.append(seen)
        try:
            async for raw in requests:
                seen.raw.append(raw)
                request = parse_request(raw)
                kind = request.WhichOneof("request")
                seen.kinds.append(kind)
                if kind in ("request_headers", "response_headers"):
                    seen.header_names.append([h.key for h in getattr(request, kind).headers.headers])
                attrs = request.attributes.get(ATTRS)
                seen.attributes.append(json_format.MessageToDict(attrs) if attrs is not None else {})
                if kind == "request_body":
                    await asyncio.sleep(self.body_delay)
                    reply = self.answer(request)
                else:
                    reply = responses.continue_other(request)
                seen.answered_at.append(time.monotonic())
                yield reply.SerializeToString()
        finally:
            seen.ended_at = time.monotonic()


@dataclass
class Received:
    at: float
    port: int
    headers: dict[str, str]
    body: bytes


class Upstream:
    """HTTP/1.1 backends that record each request and stream a short reply."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.finished_at: list[float] = []
        self.servers: list[asyncio.Server] = []

    async def start(self, count: int) -> list[int]:
        ports = []
        for _ in range(count):
            server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.servers.append(server)
            ports.append(server.sockets[0].getsockname()[1])
        return ports

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = writer.get_extra_info("sockname")[1]
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.received.append(Received(time.monotonic(), port, headers, body))
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n")
                await writer.drain()
                await asyncio.sleep(0.2)  # a stream that outlives every ext_proc message
                writer.write(b"3\r\nend\r\n0\r\n\r\n")
                await writer.drain()
                self.finished_at.append(time.monotonic())
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        for server in self.servers:
            server.close()


def bootstrap(listen: int, admin: int, extproc: int, upstreams: list[int]) -> dict[str, Any]:
    """The real bootstrap, with the model cluster static instead of from ADS."""
    text = render_bootstrap(BootstrapOptions(listen_port=listen, admin_port=admin, xds_port=free_port(),
                                             extproc_port=extproc, buffer_limit=4096))
    config = yaml.safe_load(text)
    del config["dynamic_resources"]
    cluster = json_format.MessageToDict(build_cluster(ModelConfig(name="m", endpoints=[])),
                                        preserving_proto_field_name=True)
    del cluster["eds_cluster_config"]
    cluster["type"] = "STATIC"
    cluster["load_assignment"] = {"cluster_name": cluster_name("m"), "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}} for p in upstreams]}]}
    config["static_resources"]["clusters"].append(cluster)
    return config


@dataclass
class Reply:
    status_code: int
    text: str
    headers: dict[str, str] = field(default_factory=dict)

    def error(self) -> dict[str, Any]:
        """The OpenAI-style error body; fails unless the reply is one."""
        assert self.headers.get("content-type") == "application/json", self.headers
        body = json.loads(self.text)
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        return body["error"]


async def http(port: int, method: str, path: str, headers: list[tuple[str, bytes]], body: bytes | None) -> Reply:
    """One HTTP/1.1 request with the header bytes exactly as given (repeats and non-UTF-8 included)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = [f"{method} {path} HTTP/1.1".encode(), b"host: test", b"connection: close"]
    lines += [k.encode() + b": " + v for k, v in headers]
    if body is not None:
        lines.append(b"content-length: " + str(len(body)).encode())
    writer.write(b"\r\n".join(lines) + b"\r\n\r\n" + (body or b""))
    try:
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    fields = dict(line.split(": ", 1) for line in head.decode("latin-1").split("\r\n")[1:])
    fields = {k.lower(): v for k, v in fields.items()}
    if b"transfer-encoding: chunked" in head.lower():
        text = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            text, rest = text + rest[:size], rest[size + 2:]
            if size == 0:
                break
        rest = text
    return Reply(int(head.split(b" ", 2)[1]), rest.decode("latin-1"), fields)


@dataclass
class Rig:
    extproc: ScriptedExtProc
    upstream: Upstream
    ports: list[int]
    listen: int
    retries: list[tuple[str, str]]  # what Envoy's upstream access log reported: (request id, endpoint)

    async def post(self, body: bytes | None = BODY, headers: list[tuple[str, str | bytes]] | None = None,
                   path: str = "/v1/chat/completions", method: str = "POST") -> Reply:
        pairs = [(k, v if isinstance(v, bytes) else v.encode()) for k, v in (headers or [("authorization", "Bearer k")])]
        return await http(self.listen, method, path, pairs, body)


def route(endpoints: str, cluster: str = cluster_name("m")) -> Answer:
    return lambda _r: responses.route_request_body(cluster, endpoints, model="m")


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    extproc = ScriptedExtProc()
    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(extproc.process)  # raw bytes both ways
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "envoy.service.ext_proc.v3.ExternalProcessor", {"Process": handler}),))
    retries: list[tuple[str, str]] = []
    AttemptLogServicer(lambda request_id, address: retries.append((request_id, address))).add_to(server)
    extproc_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    upstream = Upstream()
    proc: asyncio.subprocess.Process | None = None
    log = (tmp_path / "envoy.log").open("wb")
    try:
        ports = await upstream.start(2)
        listen, admin = free_port(), free_port()
        path = tmp_path / "envoy.yaml"
        path.write_text(json.dumps(bootstrap(listen, admin, extproc_port, ports)))  # JSON is YAML
        proc = await asyncio.create_subprocess_exec(
            envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1", "-l", "warning",
            stdout=log, stderr=log)
        for _ in range(200):
            try:
                if (await http(admin, "GET", "/ready", [], None)).status_code == 200:
                    break
            except (OSError, ValueError, IndexError):
                pass
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"Envoy did not start: {(tmp_path / 'envoy.log').read_text()[-2000:]}")
        yield Rig(extproc, upstream, ports, listen, retries)
    finally:
        if proc is not None:
            proc.terminate()
            await proc.wait()
        log.close()
        upstream.close()
        await server.stop(None)


async def test_router_waits_for_the_body_answer(rig: Rig) -> None:
    # With the header phase skipped, only the buffer filter keeps the router from
    # starting the upstream request before ext_proc has picked.
    rig.extproc.body_delay = 0.3
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    r = await rig.post()
    assert r.status_code == 200 and r.text == "okend"
    (stream,) = rig.extproc.streams
    (got,) = rig.upstream.received
    assert got.at >= stream.answered_at[0]


async def test_metadata_picks_cluster_and_endpoint(rig: Rig) -> None:
    for port in (rig.ports[1], rig.ports[0], rig.ports[1]):
        rig.extproc.answer = route(f"127.0.0.1:{port}")
        assert (await rig.post()).status_code == 200
        assert rig.upstream.received[-1].port == port
    # The routing headers never reach the upstream, whatever the client sent.
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    r = await rig.post(headers=[("authorization", "Bearer k"), ("x-gateway-destination-endpoint", f"127.0.0.1:{rig.ports[1]}"),
                                ("x-modeldock-cluster", "modeldock_extproc")])
    assert r.status_code == 200
    got = rig.upstream.received[-1]
    assert got.port == rig.ports[0]
    assert not {"authorization", "x-gateway-destination-endpoint", "x-modeldock-cluster"} & set(got.headers)


async def test_route_cache_is_cleared_only_with_a_header_mutation(rig: Rig) -> None:
    def without_mutation(_r: ep.ProcessingRequest) -> ep.ProcessingResponse:
        resp = responses.route_request_body(cluster_name("m"), f"127.0.0.1:{rig.ports[0]}")
        resp.request_body.response.ClearField("header_mutation")
        return resp

    rig.extproc.answer = without_mutation
    r = await rig.post()
    # The route matched before the metadata existed stays: the catch-all reply, never upstream.
    assert r.status_code == 503 and r.error()["code"] == "upstream_unavailable" and not rig.upstream.received
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    assert (await rig.post()).status_code == 200


async def test_body_answer_header_mutations_are_ignored(rig: Rig) -> None:
    def set_header(_r: ep.ProcessingRequest) -> ep.ProcessingResponse:
        resp = responses.route_request_body(cluster_name("m"), f"127.0.0.1:{rig.ports[0]}")
        resp.request_body.response.header_mutation.set_headers.add(
            header=base_pb2.HeaderValue(key="x-from-extproc", raw_value=b"1"))
        return resp

    rig.extproc.answer = set_header
    assert (await rig.post()).status_code == 200
    assert "x-from-extproc" not in rig.upstream.received[-1].headers


async def test_attributes_ride_on_the_only_message(rig: Rig) -> None:
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    r = await rig.post(headers=[("authorization", "Bearer a"), ("authorization", "Bearer b")],
                       path="/v1/chat/completions?x=1")
    assert r.status_code == 200
    (stream,) = rig.extproc.streams
    assert stream.kinds == ["request_body"]  # response headers are skipped
    (body_attrs,) = stream.attributes
    assert body_attrs["request.method"] == "POST"
    assert body_attrs["request.path"] == "/v1/chat/completions?x=1"
    assert body_attrs["request.headers['authorization']"] == "Bearer a,Bearer b"  # joined
    assert body_attrs["request.id"] == rig.upstream.received[-1].headers["x-request-id"]
    # No Authorization header: the attribute is left out.
    await rig.post(headers=[("content-type", "application/json")])
    assert "request.headers['authorization']" not in rig.extproc.streams[-1].attributes[0]


async def test_stream_stays_open_until_the_response_ends(rig: Rig) -> None:
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    assert (await rig.post()).text == "okend"
    await asyncio.sleep(0.1)
    (stream,) = rig.extproc.streams
    assert stream.ended_at >= rig.upstream.finished_at[0]
    assert stream.ended_at - stream.answered_at[-1] >= 0.15  # the 0.2 s reply, not the last answer


@pytest.mark.parametrize(("method", "path", "status", "code"), [
    ("POST", "/v1/chat/completions", 400, "invalid_body"), ("POST", "/v1/completions?x=1", 400, "invalid_body"),
    ("GET", "/v1/chat/completions", 400, "method_not_allowed"), ("DELETE", "/any\"thing", 404, "unknown_url")])
async def test_a_bodiless_request_never_reaches_ext_proc_and_gets_a_json_error(rig: Rig, method: str, path: str,
                                                                            status: int, code: str) -> None:
    r = await rig.post(body=None, method=method, path=path, headers=[
        ("authorization", "Bearer k"), ("x-modeldock-cluster", cluster_name("m")),
        ("x-gateway-destination-endpoint", f"127.0.0.1:{rig.ports[0]}")])
    assert (r.status_code, r.error()["code"]) == (status, code)
    assert not rig.upstream.received and not rig.extproc.streams
    if code != "invalid_body":
        assert path in r.error()["message"]  # escaped by Envoy's JSON formatter


async def test_envoys_reply_after_every_endpoint_failed_is_a_json_503(rig: Rig) -> None:
    rig.upstream.close()  # nothing listens on either endpoint any more
    await asyncio.sleep(0.05)
    rig.extproc.answer = route(",".join(f"127.0.0.1:{p}" for p in rig.ports))
    r = await rig.post()
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    err = r.error()
    assert err["code"] == "upstream_unavailable" and err["type"] == "server_error"
    # The details (connection_failure, ...) stay in the access log; the client gets a plain message.
    assert "`m`" in err["message"] and "connection_failure" not in err["message"] and "upstream" not in err["message"]
    assert rig.extproc.streams[0].kinds == ["request_body"]


async def test_ext_procs_own_replies_pass_unchanged(rig: Rig) -> None:
    rig.extproc.answer = lambda _r: responses.rejection_response(Unauthorized("no such key"))
    r = await rig.post()
    assert r.status_code == 401
    assert r.error() == Unauthorized("no such key").body()["error"]


async def test_ext_proc_failing_is_a_json_503(rig: Rig) -> None:
    def fail(_r: ep.ProcessingRequest) -> ep.ProcessingResponse:
        raise RuntimeError("broken")

    rig.extproc.answer = fail
    r = await rig.post()
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.error()["code"] == "gateway_unavailable" and not rig.upstream.received


async def test_a_retry_is_reported_by_the_upstream_access_log(rig: Rig) -> None:
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[1]},127.0.0.1:{rig.ports[0]}")
    assert (await rig.post()).status_code == 200
    await asyncio.sleep(0.1)
    assert rig.retries == []  # first attempts are not logged
    rig.upstream.servers[0].close()  # never connected to: the primary below refuses, Envoy retries
    await asyncio.sleep(0.05)
    rig.extproc.answer = route(",".join(f"127.0.0.1:{p}" for p in rig.ports))
    assert (await rig.post()).status_code == 200
    got = rig.upstream.received[-1]
    assert got.port == rig.ports[1] and got.headers["x-envoy-attempt-count"] == "2"
    for _ in range(100):
        if rig.retries:
            break
        await asyncio.sleep(0.01)
    assert rig.retries == [(got.headers["x-request-id"], f"127.0.0.1:{rig.ports[1]}")]


async def test_ratelimit_headers_come_from_the_route_metadata(rig: Rig) -> None:
    limits = {"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
              "x-ratelimit-reset-requests": "1s"}
    rig.extproc.answer = lambda _r: responses.route_request_body(cluster_name("m"), f"127.0.0.1:{rig.ports[0]}",
                                                                 model="m", response_headers=limits)
    r = await rig.post()
    assert r.status_code == 200 and {k: r.headers[k] for k in limits} == limits
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    r = await rig.post()
    assert r.status_code == 200 and not [k for k in r.headers if k.startswith("x-ratelimit")]


async def test_content_length_follows_a_rewritten_body(rig: Rig) -> None:
    new = b'{"model":"a-much-longer-upstream-name","messages":[]}'
    rig.extproc.answer = lambda _r: responses.route_request_body(cluster_name("m"), f"127.0.0.1:{rig.ports[0]}", new)
    assert (await rig.post()).status_code == 200
    got = rig.upstream.received[-1]
    assert got.body == new and got.headers["content-length"] == str(len(new))
    # Not rewritten: the client's length stands.
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    await rig.post()
    assert rig.upstream.received[-1].headers["content-length"] == str(len(BODY))


async def test_models_route_sends_request_headers(rig: Rig) -> None:
    r = await rig.post(body=None, method="GET", path="/v1/models",
                       headers=[("authorization", "Bearer k"), ("x-other", "1"), ("x-request-id", "r-1")])
    # The scripted servicer answers headers with "continue", so the route's own reply follows.
    assert r.status_code == 404
    (stream,) = rig.extproc.streams
    assert stream.kinds == ["request_headers"]
    # forward_rules: only the headers ext_proc reads are copied into the message.
    assert sorted(stream.header_names[0]) == [":method", ":path", "authorization", "x-request-id"]


async def test_a_body_over_the_buffer_limit_is_refused_by_envoy(rig: Rig) -> None:
    r = await rig.post(body=b"x" * 5000)
    assert r.status_code == 413 and r.error()["code"] == "request_too_large" and "4096" in r.error()["message"]
    assert not rig.upstream.received and not rig.extproc.streams


async def test_header_bytes_that_are_not_utf8_reach_ext_proc_as_is(rig: Rig) -> None:
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    await rig.post(headers=[("authorization", b"Bearer \xff\xfe")])
    raw = rig.extproc.streams[0].raw[0]
    # upb refuses the message; modeldock's decoder keeps it, with the bytes replaced.
    with pytest.raises(message.DecodeError):
        ep.ProcessingRequest.FromString(raw)
    attrs = parse_request(raw).attributes[ATTRS]
    assert attrs.fields["request.headers['authorization']"].string_value == "Bearer \ufffd\ufffd"


def test_bootstrap_uses_one_catch_all_and_a_metadata_gated_route() -> None:
    """The layout the facts above assume; the rest of the bootstrap is covered end to end."""
    config = yaml.safe_load(render_bootstrap(BootstrapOptions(listen_port=1, admin_port=2, xds_port=3,
                                                              extproc_port=4)))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["modeldock.strip_routing_headers", "envoy.filters.http.ext_proc", "envoy.filters.http.buffer",
                     "modeldock.route_from_metadata", "envoy.filters.http.router"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert [("direct_response" in r, "dynamic_metadata" in r["match"]) for r in routes] == [
        (True, False), (False, True), (True, False)]
    assert json.dumps(routes[1]["match"]["dynamic_metadata"]).count("present_match") == 1
