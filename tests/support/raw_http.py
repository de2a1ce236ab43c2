"""A TCP server that answers each request head with whatever bytes a test scripts, for HTTP framing tests.

    async with RawServer(lambda head: Answer(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok")) as server:
        page = await client.get(server.endpoint)
    assert server.connections == 1 and server.heads[0].startswith(b"GET /metrics HTTP/1.1")

`Answer(data, close=True)` closes the connection after writing; `Answer(parts=[...])` writes in pieces,
one per loop turn (a body that arrives split); `Answer(b"")` answers nothing (the test closes or waits).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from modeldock.types import Endpoint


@dataclass
class Answer:
    data: bytes = b""
    close: bool = False
    parts: list[bytes] = field(default_factory=list)


class _Conn(asyncio.Protocol):
    def __init__(self, server: RawServer) -> None:
        self._server = server
        self._buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._server.connections += 1
        self._server.open.add(self)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while self.transport is not None and b"\r\n\r\n" in self._buffer:
            head, _, self._buffer = self._buffer.partition(b"\r\n\r\n")
            self._server.heads.append(head)
            answer = self._server.answer(head)
            if answer.parts:
                asyncio.get_running_loop().create_task(self._trickle(answer))
                continue
            self.transport.write(answer.data)
            if answer.close:
                self.transport.close()

    async def _trickle(self, answer: Answer) -> None:
        for part in answer.parts:
            if self.transport is None:
                return
            self.transport.write(part)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        if answer.close and self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._server.open.discard(self)


class RawServer:
    def __init__(self, answer: Callable[[bytes], Answer]) -> None:
        self.answer = answer
        self.heads: list[bytes] = []
        self.connections = 0
        self.open: set[_Conn] = set()
        self._server: asyncio.Server | None = None
        self.endpoint = Endpoint("127.0.0.1", 0)

    async def __aenter__(self) -> RawServer:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Conn(self), "127.0.0.1", 0)
        self.endpoint = Endpoint("127.0.0.1", self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.drop_connections()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def drop_connections(self) -> None:
        """Close every open connection from the server's side (as a server's keep-alive timeout does)."""
        for conn in list(self.open):
            if conn.transport is not None:
                conn.transport.close()
