"""Many static /metrics pages on loopback, each on its own port, for as little CPU as possible.

    server = PageServer()
    sites = await server.start(3, vllm_page)     # three endpoints serving the same page
    sites[0].page = other_page                   # one of them changes
    sites[1].etag = True                         # ...another answers If-None-Match with 304
    assert sites[0].requests == 2 and sites[0].connections == 1
    await server.close()

A raw asyncio protocol, not aiohttp's server: the scrape-cost benchmark runs thousands of these
in one process beside the scraper it measures, so a request must cost a few microseconds. It
speaks just enough HTTP/1.1 for a GET: keep-alive unless the client says close, any body ignored.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass, field

from modeldock.types import Endpoint


@dataclass
class Site:
    """One endpoint's page and what it saw."""

    endpoint: Endpoint
    requests: int = 0
    connections: int = 0  # accepted so far (a kept-alive client opens one)
    not_modified: int = 0  # answered 304
    etag: bool = False  # send an ETag (the page's CRC) and honour If-None-Match
    _page: bytes = b""
    _tag: bytes = b""
    _response: bytes = b""
    _tagged: bytes = b""
    peers: set[object] = field(default_factory=set)

    @property
    def page(self) -> str:
        return self._page.decode()

    @page.setter
    def page(self, text: str) -> None:
        body = text.encode()
        self._page, self._tag = body, b'"%08x"' % zlib.crc32(body)
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: %d\r\n" % len(body)
        self._response = head + b"\r\n" + body
        self._tagged = head + b"ETag: " + self._tag + b"\r\n\r\n" + body

    def answer(self, head: bytes) -> bytes:
        self.requests += 1
        if not self.etag:
            return self._response
        if b"if-none-match: " + self._tag in head.lower():
            self.not_modified += 1
            return b"HTTP/1.1 304 Not Modified\r\nETag: " + self._tag + b"\r\nContent-Length: 0\r\n\r\n"
        return self._tagged


class _Connection(asyncio.Protocol):
    def __init__(self, site: Site, open_: set[_Connection]) -> None:
        self._site = site
        self._open = open_
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._open.add(self)
        self._site.connections += 1
        self._site.peers.add(transport.get_extra_info("peername"))

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while self._transport is not None:
            end = self._buffer.find(b"\r\n\r\n")
            if end == -1:
                return
            head, self._buffer = self._buffer[:end], self._buffer[end + 4:]
            self._transport.write(self._site.answer(head))
            if b"connection: close" in head.lower():
                self._transport.close()
                self._transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._open.discard(self)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


class PageServer:
    def __init__(self) -> None:
        self._servers: list[asyncio.Server] = []
        self._open: set[_Connection] = set()
        self.sites: list[Site] = []

    async def start(self, n: int, page: str, host: str = "127.0.0.1") -> list[Site]:
        """`n` more endpoints serving `page`, each on a port of its own; returns their sites."""
        loop = asyncio.get_running_loop()
        added = []
        for _ in range(n):
            site = Site(Endpoint(host, 0))
            site.page = page
            server = await loop.create_server(lambda s=site: _Connection(s, self._open), host, 0, backlog=64)  # type: ignore[misc]
            site.endpoint = Endpoint(host, server.sockets[0].getsockname()[1])
            self._servers.append(server)
            added.append(site)
        self.sites += added
        return added

    async def close(self) -> None:
        for server in self._servers:
            server.close()
        for connection in list(self._open):
            connection.close()
        for server in self._servers:
            await server.wait_closed()
        self._servers.clear()
