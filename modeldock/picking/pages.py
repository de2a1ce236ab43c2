"""Fetch /metrics pages over kept-alive HTTP/1.1 connections, one per endpoint, for little CPU.

The scraper reads every endpoint's page again and again, and a general HTTP client's
machinery per request (aiohttp's session, request and response objects, timers, cookie and
header handling) cost about as much CPU as the rest of a read together: ~150 µs of the ~270 µs
a read took (benchmarks/scrape_cost.py). Scraping needs one thing: GET a page from an IP
literal, over a connection kept open between reads. This is that, on asyncio's protocols.

What it speaks: HTTP/1.1 GET, responses framed by Content-Length, chunked transfer encoding
(uvicorn, vLLM's server, chunks a body that prometheus_client gives no length) or the
connection's end; `Connection: close` honoured; 1xx skipped; 204 and 304 bodiless. It asks for
the page uncompressed (inflating 35 KB costs about as much as parsing it; the network carries
it instead). A kept-alive connection the server had closed by the time it was reused is
reopened once. Timeouts are the caller's: a read cancelled midway closes its connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass

from modeldock.types import Endpoint


class PageError(Exception):
    """A read that gave no page: `reason` is the scraper's failure reason (connect, too_large)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Reset(Exception):
    """The connection closed before any byte of the answer: a reused one may be retried."""


@dataclass(frozen=True, slots=True)
class Page:
    status: int
    body: bytes
    etag: str | None = None
    last_modified: str | None = None


class _Connection(asyncio.Protocol):
    """One connection; one request on it at a time."""

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.busy = False
        self._waiter: asyncio.Future[Page] | None = None
        self._buf = bytearray()
        self._status = 0  # 0: the head is not in yet
        self._headers: dict[bytes, bytes] = {}
        self._length = -1  # -1: to the connection's end; -2: chunked
        self._pos = 0  # chunked: where the next chunk's size line starts
        self._chunks: list[bytes] = []
        self._size = 0
        self._trailer = False
        self._received = False

    # -- asyncio's calls --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():  # nothing asked for (or given up on): the stream is not ours to read
            self.abort()
            return
        self._received = True
        self._buf += data
        try:
            page = self._advance()
        except PageError as exc:
            self._fail(exc)
            return
        except (ValueError, IndexError):
            self._fail(PageError("connect"))  # not HTTP as we speak it
            return
        if page is not None:
            self._finish(page)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._status and self._length == -1:  # framed by the connection's end: this was the body
            self._finish(self._page(bytes(self._buf)))
        elif self._received:
            waiter.set_exception(PageError("connect"))
        else:
            waiter.set_exception(_Reset())

    # -- the request --

    def request(self, data: bytes) -> asyncio.Future[Page]:
        assert self.transport is not None
        waiter: asyncio.Future[Page] = asyncio.get_running_loop().create_future()
        self._waiter, self.busy = waiter, True
        self._buf.clear()
        self._status, self._headers, self._length = 0, {}, -1
        self._pos, self._chunks, self._size, self._trailer, self._received = 0, [], 0, False, False
        self.transport.write(data)
        return waiter

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
            self.transport = None

    def _fail(self, exc: PageError) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        self.abort()

    def _finish(self, page: Page) -> None:
        keep = self._headers.get(b"connection", b"").lower() != b"close" and self._length != -1
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(page)
        self._waiter, self.busy = None, False
        if not keep:
            self.abort()

    def _page(self, body: bytes) -> Page:
        etag, modified = self._headers.get(b"etag"), self._headers.get(b"last-modified")
        return Page(self._status, body, etag.decode("latin-1") if etag else None,
                    modified.decode("latin-1") if modified else None)

    # -- framing --

    def _advance(self) -> Page | None:
        buf = self._buf
        while not self._status:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > 65536:
                    raise PageError("connect")  # no head within 64 KiB: not a metrics server
                return None
            self._head(bytes(buf[:end]))
            del buf[:end + 4]
        if self._length >= 0:
            return self._page(bytes(buf[:self._length])) if len(buf) >= self._length else None
        if self._length == -2:
            return self._dechunk()
        if len(buf) > self._max:
            raise PageError("too_large")
        return None  # to the connection's end

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        version, status = lines[0].split(b" ", 2)[:2]
        if not version.startswith(b"HTTP/1."):
            raise ValueError("not HTTP/1.x")
        code = int(status)
        if 100 <= code < 200:
            return  # an interim answer: the real head follows
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if version == b"HTTP/1.0" and headers.get(b"connection", b"").lower() != b"keep-alive":
            headers[b"connection"] = b"close"
        self._status, self._headers = code, headers
        if code in (204, 304):
            self._length = 0
        elif b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            self._length = -2
        elif b"content-length" in headers:
            self._length = int(headers[b"content-length"])
            if self._length > self._max:
                raise PageError("too_large")

    def _dechunk(self) -> Page | None:
        buf = self._buf
        while True:
            if self._trailer:  # after the last chunk: an empty line, or trailers and then one
                if buf.startswith(b"\r\n", self._pos) or buf.find(b"\r\n\r\n", self._pos) >= 0:
                    return self._page(b"".join(self._chunks))
                return None
            eol = buf.find(b"\r\n", self._pos)
            if eol < 0:
                return None
            size = int(bytes(buf[self._pos:eol]).split(b";", 1)[0], 16)
            if size == 0:
                self._trailer, self._pos = True, eol + 2
                continue
            start = eol + 2
            if len(buf) < start + size + 2:
                return None
            self._size += size
            if self._size > self._max:
                raise PageError("too_large")
            self._chunks.append(bytes(buf[start:start + size]))
            self._pos = start + size + 2


class PageClient:
    """GET `path` from endpoints, one kept-alive connection each. `get` raises PageError."""

    def __init__(self, path: str = "/metrics", max_bytes: int = 8 * 1024 * 1024) -> None:
        self._path = path if path.startswith("/") else "/" + path
        self._max = max_bytes
        self._pool: dict[Endpoint, _Connection] = {}
        self._requests: dict[Endpoint, bytes] = {}
        self.opened = 0  # connections opened so far (a kept-alive pool opens one per endpoint)

    async def get(self, endpoint: Endpoint, headers: dict[str, str] | None = None) -> Page:
        request = self._requests.get(endpoint)
        if request is None:  # built once per endpoint
            request = self._requests[endpoint] = (
                f"GET {self._path} HTTP/1.1\r\nHost: {endpoint.address}\r\nUser-Agent: modeldock\r\n"
                "Accept: text/plain\r\nAccept-Encoding: identity\r\n").encode("latin-1")
        if headers:
            request += "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode("latin-1")
        request += b"\r\n"
        conn = self._pool.get(endpoint)
        reused = conn is not None and not conn.closed and not conn.busy
        if not reused:
            conn = await self._connect(endpoint)
        assert conn is not None
        try:
            return await self._send(conn, request)
        except _Reset:
            if not reused:
                raise PageError("connect") from None
        return await self._send(await self._connect(endpoint), request)  # the server had closed it meanwhile

    async def _send(self, conn: _Connection, request: bytes) -> Page:
        try:
            return await conn.request(request)
        except BaseException:  # cancelled (a timeout) or failed midway: the stream's state is unknown
            conn.abort()
            raise

    async def _connect(self, endpoint: Endpoint) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self._max), endpoint.host, endpoint.port)
        except OSError:
            raise PageError("connect") from None
        self.opened += 1
        old = self._pool.get(endpoint)
        if old is None or old.closed or not old.busy:
            if old is not None and old is not conn:
                old.abort()
            self._pool[endpoint] = conn
        return conn

    def forget(self, keep: Iterable[Endpoint]) -> None:
        """Close the connections of endpoints not in `keep`."""
        wanted = set(keep)
        for ep in [ep for ep in self._pool if ep not in wanted]:
            self._pool.pop(ep).abort()
        for ep in [ep for ep in self._requests if ep not in wanted]:
            del self._requests[ep]

    def close(self) -> None:
        for conn in self._pool.values():
            conn.abort()
        self._pool.clear()
