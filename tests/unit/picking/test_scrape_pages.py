"""The page client (pages.py): HTTP/1.1 framing, kept-alive connections, failures as reasons."""

from __future__ import annotations

import asyncio

import pytest

from modeldock.picking.pages import PageClient, PageError
from modeldock.types import Endpoint
from tests.support.raw_http import Answer, RawServer

pytestmark = pytest.mark.timeout(30)

BODY = b"vllm:num_requests_waiting 1\n" * 100


def _sized(body: bytes = BODY, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


def _chunked(body: bytes = BODY, trailer: bytes = b"") -> bytes:
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(body[i:i + 700]), body[i:i + 700]) for i in range(0, len(body), 700))
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n" + trailer + b"\r\n"


async def test_kept_alive_content_length_and_the_request_it_sends() -> None:
    client = PageClient("/metrics")
    async with RawServer(lambda head: Answer(_sized(extra=b'ETag: "abc"\r\n'))) as server:
        for _ in range(3):
            page = await client.get(server.endpoint, {"If-None-Match": '"abc"'})
            assert (page.status, page.body, page.etag) == (200, BODY, '"abc"')
        assert server.connections == 1 and client.opened == 1
        head = server.heads[0].decode()
        assert head.startswith("GET /metrics HTTP/1.1\r\n")
        assert f"Host: {server.endpoint.address}" in head
        assert "Accept-Encoding: identity" in head and 'If-None-Match: "abc"' in head
    client.close()


async def test_chunked_bodies_with_and_without_trailers_split_anywhere() -> None:
    client = PageClient()
    whole, trailed = _chunked(), _chunked(trailer=b"X-Trailer: 1\r\n")
    answers = iter([Answer(whole), Answer(trailed),
                    Answer(parts=[whole[i:i + 37] for i in range(0, len(whole), 37)])])
    async with RawServer(lambda head: next(answers)) as server:
        for _ in range(3):
            assert (await client.get(server.endpoint)).body == BODY
        assert server.connections == 1
    client.close()


async def test_interim_answers_304_and_close_framing() -> None:
    client = PageClient()
    answers = iter([
        Answer(b"HTTP/1.1 100 Continue\r\n\r\n" + _sized()),
        Answer(b'HTTP/1.1 304 Not Modified\r\nETag: "x"\r\n\r\n'),
        Answer(b"HTTP/1.0 200 OK\r\n\r\n" + BODY, close=True),  # framed by the connection's end
        Answer(_sized(extra=b"Connection: close\r\n")),
        Answer(_sized(b"", extra=b"")),
    ])
    async with RawServer(lambda head: next(answers)) as server:
        assert (await client.get(server.endpoint)).body == BODY
        page = await client.get(server.endpoint)
        assert (page.status, page.body, page.etag) == (304, b"", '"x"')
        assert (await client.get(server.endpoint)).body == BODY
        assert (await client.get(server.endpoint)).body == BODY
        assert (await client.get(server.endpoint)).status == 200
        assert server.connections == 3  # the close-framed answer and `Connection: close` each end theirs
    client.close()


async def test_a_connection_the_server_closed_while_idle_is_reopened_once() -> None:
    client = PageClient()
    async with RawServer(lambda head: Answer(_sized())) as server:
        await client.get(server.endpoint)
        server.drop_connections()  # the server's keep-alive timeout
        await asyncio.sleep(0.05)  # let the close arrive (or not: either way the read succeeds)
        assert (await client.get(server.endpoint)).body == BODY
        assert server.connections == 2
    client.close()


async def test_a_reused_connection_reset_before_the_answer_is_retried_on_a_new_one() -> None:
    client = PageClient()
    answers = iter([Answer(_sized()), Answer(b"", close=True), Answer(_sized())])
    async with RawServer(lambda head: next(answers)) as server:
        await client.get(server.endpoint)
        assert (await client.get(server.endpoint)).body == BODY  # closed without a byte: sent again
        assert server.connections == 2 and len(server.heads) == 3
    client.close()


async def test_failures_have_reasons() -> None:
    client = PageClient(max_bytes=1000)
    answers = iter([
        Answer(_sized()),  # Content-Length above max_bytes
        Answer(_chunked()),  # chunks summing above it
        Answer(b"HTTP/1.1 200 OK\r\n\r\n" + BODY, close=True),  # to the end, above it
        Answer(b"SSH-2.0-OpenSSH\r\n\r\n"),  # not HTTP
        Answer(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort", close=True),  # cut midway
        Answer(b"", close=True),  # a fresh connection closed without an answer
    ])
    async with RawServer(lambda head: next(answers)) as server:
        for reason in ("too_large", "too_large", "too_large", "connect", "connect", "connect"):
            with pytest.raises(PageError) as caught:
                await client.get(server.endpoint)
            assert caught.value.reason == reason
        assert len(server.heads) == 6  # nothing retried: each failed connection was a new one
    with pytest.raises(PageError) as refused:
        await client.get(Endpoint("127.0.0.1", 1))
    assert refused.value.reason == "connect"
    client.close()


async def test_a_read_cancelled_midway_closes_its_connection_and_the_next_one_starts_clean() -> None:
    client = PageClient()
    answers = iter([Answer(b"HTTP/1.1 200 OK\r\nContent-Length: 9999\r\n\r\npartial"), Answer(_sized())])
    async with RawServer(lambda head: next(answers)) as server:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await client.get(server.endpoint)
        assert (await client.get(server.endpoint)).body == BODY
        assert server.connections == 2
    client.close()


async def test_forget_closes_the_connections_of_endpoints_gone() -> None:
    client = PageClient()
    async with RawServer(lambda head: Answer(_sized())) as a, RawServer(lambda head: Answer(_sized())) as b:
        await client.get(a.endpoint)
        await client.get(b.endpoint)
        client.forget([b.endpoint])
        await asyncio.sleep(0.05)
        assert not a.open and len(b.open) == 1
    client.close()
