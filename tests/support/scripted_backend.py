"""An HTTP/1.1 backend whose every reply is a test's own coroutine, for pinning what Envoy does with it.

    backend = ScriptedBackend(reply)          # reply(request, writer) writes the response, or closes
    port = await backend.start()

`reply` gets the parsed request (its body already read in full) and the writer; it may write in as
many pieces as it likes (`chunk` frames one piece of a chunked body), wait between them, or return
without a byte (Envoy sees the connection close). Used by tests/e2e/test_usage_split_events.py and
tests/e2e/test_request_outcomes.py; tests/support/envoy_rig.py's `Upstream` covers the fixed modes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class BackendRequest:
    at: float  # time.monotonic() when the whole body was in
    headers: dict[str, str]
    body: bytes


Reply = Callable[[BackendRequest, asyncio.StreamWriter], Awaitable[None]]

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"


def chunk(data: bytes) -> bytes:
    """One piece of a chunked HTTP/1.1 body."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def json_reply(status: int, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
            .encode() + body)


class ScriptedBackend:
    def __init__(self, reply: Reply) -> None:
        self.reply = reply
        self.received: list[BackendRequest] = []
        self.closed_at: list[float] = []  # when the client side (Envoy) closed a connection
        self._server: asyncio.Server | None = None
        self.port = 0
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            request = BackendRequest(time.monotonic(), headers, body)
            self.received.append(request)
            await self.reply(request, writer)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_at.append(time.monotonic())
        finally:
            writer.close()
            if task is not None:
                self._handlers.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)


def rig_edit(backend_ports: list[int], usage_log_port: int) -> Callable[[dict[str, Any]], None]:
    """An `envoy_rig` edit: these backends join the model cluster (so override_host can pick them), and
    the bootstrap's own usage log (log_name modeldock_usage, its filter and buffering as rendered) goes
    to a test's gRPC access log service on `usage_log_port` instead of the scripted ext_proc."""
    from modeldock.extproc.attempts import USAGE_LOG_NAME
    from modeldock.types import cluster_name

    def edit(config: dict[str, Any]) -> None:
        resources = config["static_resources"]
        resources["clusters"].append({
            "name": "test_usage_log", "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": "test_usage_log", "endpoints": [{"lb_endpoints": [
                _endpoint(usage_log_port)]}]}})
        hcm = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        usage_logs = [log["typed_config"]["common_config"] for log in hcm["access_log"]
                      if log["typed_config"].get("common_config", {}).get("log_name") == USAGE_LOG_NAME]
        assert usage_logs, "the bootstrap has no usage log"
        for common in usage_logs[:1]:
            common["grpc_service"] = {"envoy_grpc": {"cluster_name": "test_usage_log"}}
        model = next(c for c in resources["clusters"] if c["name"] == cluster_name("m"))
        model["load_assignment"]["endpoints"][0]["lb_endpoints"] += [_endpoint(p) for p in backend_ports]

    return edit


def _endpoint(port: int) -> dict[str, Any]:
    return {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}


@dataclass
class Streamed:
    status: int
    headers: dict[str, str]
    pieces: list[bytes]  # the decoded body as it arrived, one item per HTTP/1.1 chunk Envoy sent

    @property
    def body(self) -> bytes:
        return b"".join(self.pieces)


async def stream_post(port: int, body: bytes, headers: list[tuple[str, str]],
                      on_piece: Callable[[bytes], None] = lambda _piece: None, *, timeout: float = 10.0,
                      path: str = "/v1/chat/completions") -> Streamed:
    """POST over HTTP/1.1 and read a chunked reply piece by piece, calling `on_piece` with the body so far."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = [f"POST {path} HTTP/1.1", "host: test", "connection: close", *(f"{k}: {v}" for k, v in headers),
             f"content-length: {len(body)}"]
    writer.write("\r\n".join(lines).encode() + b"\r\n\r\n" + body)
    try:
        async with asyncio.timeout(timeout):
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:] if line)}
            got = Streamed(int(head[0].split(" ", 2)[1]), fields, [])
            if fields.get("transfer-encoding") != "chunked":
                got.pieces.append(await reader.read())
                return got
            while True:
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                data = (await reader.readexactly(size + 2))[:-2]
                if size == 0:
                    return got
                got.pieces.append(data)
                on_piece(got.body)
    finally:
        writer.close()
