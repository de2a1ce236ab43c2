"""Real Envoy on the real bootstrap, with a scripted ext_proc and recording upstreams.

`envoy_rig` runs `render_bootstrap` with the ADS parts swapped for a static model cluster,
so tests pin what the bootstrap itself does (tests/e2e/test_envoy_facts.py,
tests/e2e/test_hardening_envoy.py). Each upstream port can be told how to answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import json_format

from modeldock import replies
from modeldock.config import ListenerConfig, ModelConfig
from modeldock.envoy import BootstrapOptions, envoy_binary, render_bootstrap
from modeldock.extproc import responses
from modeldock.extproc.attempts import AttemptLogServicer
from modeldock.extproc.wire import parse_request
from modeldock.types import cluster_name
from modeldock.up import free_port
from modeldock.xds.resources import build_cluster

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
        self.answer: Answer = replies.continue_other
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
                    reply = replies.continue_other(request)
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
    """HTTP/1.1 backends that record each request and stream a short reply.

    `modes[port]` says how that port answers: "ok" (the default: a chunk, `reply_seconds`, a last
    chunk), "503" or "500" (an empty reply with that status), "reset" (close without a byte),
    "cut" (the headers and a first chunk, then close).
    """

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.finished_at: list[float] = []
        self.servers: list[asyncio.Server] = []
        self.modes: dict[int, str] = {}
        self.reply_seconds = 0.2

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
                headers = {
                    k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.received.append(Received(time.monotonic(), port, headers, body))
                mode = self.modes.get(port, "ok")
                if mode in ("503", "500"):
                    writer.write(f"HTTP/1.1 {mode} X\r\ncontent-length: 0\r\n\r\n".encode())
                    await writer.drain()
                    continue
                if mode == "reset":
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nserver: backend/1.0\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n")
                await writer.drain()
                if mode == "cut":
                    return
                await asyncio.sleep(self.reply_seconds)  # a stream that outlives every ext_proc message
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


def bootstrap(listen: int, admin: int, extproc: int, upstreams: list[int],
              listener: ListenerConfig | None = None) -> dict[str, Any]:
    """The real bootstrap, with the model cluster static instead of from ADS."""
    text = render_bootstrap(BootstrapOptions(listen_port=listen, admin_port=admin, xds_port=free_port(),
                                             extproc_port=extproc, buffer_limit=4096,
                                             listener=listener or ListenerConfig()))
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
    retries: list[tuple[str, str]]  # what Envoy's upstream access log reported: (modeldock:rid, endpoint)
    log: Path  # Envoy's stdout and stderr: the access log
    admin: int
    server: grpc.aio.Server  # the scripted ext_proc's

    async def stat(self, name: str) -> int:
        reply = await http(self.admin, "GET", f"/stats?filter=^{name}$", [], None)
        return sum(int(line.split(": ", 1)[1]) for line in reply.text.splitlines() if ": " in line)

    async def access_log(self, count: int = 1) -> list[str]:
        """Envoy's access log lines, once there are `count` (each is written when its stream ends)."""
        for _ in range(200):
            lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.startswith("[")
                     and '"' in line and " id=" in line]
            if len(lines) >= count:
                return lines
            await asyncio.sleep(0.02)
        raise AssertionError(f"fewer than {count} access log lines:\n{self.log.read_text()[-2000:]}")

    async def post(self, body: bytes | None = BODY, headers: list[tuple[str, str | bytes]] | None = None,
                   path: str = "/v1/chat/completions", method: str = "POST") -> Reply:
        pairs = [
            (k, v if isinstance(v, bytes) else v.encode()) for k, v in (headers or [("authorization", "Bearer k")])
        ]
        return await http(self.listen, method, path, pairs, body)


def route(endpoints: str, cluster: str = cluster_name("m"), *, rid: str = "", tenant: str = "") -> Answer:
    return lambda _r: responses.route_request_body(cluster, endpoints, model="m", rid=rid, tenant=tenant)


@asynccontextmanager
async def envoy_rig(tmp_path: Path, listener: ListenerConfig | None = None,
                    edit: Callable[[dict[str, Any]], None] | None = None) -> AsyncIterator[Rig]:
    """`edit` may change the bootstrap (a dict) before Envoy starts, e.g. to add a test's access log."""
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
        config = bootstrap(listen, admin, extproc_port, ports, listener)
        if edit is not None:
            edit(config)
        path.write_text(json.dumps(config))  # JSON is YAML
        proc = await asyncio.create_subprocess_exec(
            envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1", "-l", "warning",
            "--file-flush-interval-msec", "20",  # the access log, at once
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
        yield Rig(extproc, upstream, ports, listen, retries, tmp_path / "envoy.log", admin, server)
    finally:
        if proc is not None:
            proc.terminate()
            await proc.wait()
        log.close()
        upstream.close()
        await server.stop(None)


