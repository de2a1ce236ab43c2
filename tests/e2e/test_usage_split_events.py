"""The usage event the gateway added is removed however the backend's bytes arrive (issue 26, hole 7).

Real Envoy on the real bootstrap (`envoy_rig`), a scripted backend that writes the usage event in
pieces, and the bootstrap's own usage log sent to a test collector. Each piece reaches Envoy as its
own body chunk: the backend writes the next one only once the client saw the previous bytes, or
(for pieces Envoy holds back) once Envoy's upstream byte counter shows it read them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from modeldock.budgets.tokens import Usage
from modeldock.extproc import responses
from modeldock.extproc.attempts import usage_reports
from modeldock.gateway.settlement import UsageReport
from modeldock.types import cluster_name
from tests.support.access_log import AccessLogCollector
from tests.support.envoy_rig import BODY, Rig, envoy_rig
from tests.support.extproc_messages import usage_log_message
from tests.support.scripted_backend import (
    LAST_CHUNK,
    SSE_HEAD,
    BackendRequest,
    ScriptedBackend,
    chunk,
    rig_edit,
    stream_post,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

CONTENT = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
USAGE = (b'data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":7,'
         b'"completion_tokens":3,"total_tokens":10,"prompt_tokens_details":{"cached_tokens":4}}}\n\n')
DONE = b"data: [DONE]\n\n"
EXPECTED_USAGE = Usage(7, 3, 4)
RX_BYTES = f"cluster.{cluster_name('m').replace(':', '_')}.upstream_cx_rx_bytes_total"


@dataclass
class SplitRig:
    rig: Rig
    backend: ScriptedBackend
    port: int
    logs: AccessLogCollector

    def route(self, rid: str, *, drop_usage: bool = True) -> None:
        self.rig.extproc.answer = lambda _r: responses.route_request_body(
            cluster_name("m"), f"127.0.0.1:{self.port}", model="m", rid=rid, usage=True, drop_usage=drop_usage)

    async def report(self, rid: str) -> UsageReport:
        heard = await self.logs.wait_for(lambda e: e.common_properties.metadata.filter_metadata[
            "modeldock"].fields["rid"].string_value == rid)
        message = usage_log_message()
        message.http_logs.log_entry.add().CopyFrom(heard.entry)
        (report,) = usage_reports(message)
        return report

    async def envoy_read(self, total: int) -> None:
        """Until Envoy has read `total` bytes from backends (its counter moves as each read happens)."""
        async with asyncio.timeout(5):
            while await self.rig.stat(RX_BYTES) < total:
                await asyncio.sleep(0.001)


@pytest.fixture
async def split(tmp_path: Path, access_log: tuple[AccessLogCollector, int]) -> AsyncIterator[SplitRig]:
    logs, log_port = access_log

    async def unset(_request: BackendRequest, _writer: asyncio.StreamWriter) -> None:
        raise AssertionError("each test sets the reply")

    backend = ScriptedBackend(unset)
    port = await backend.start()
    try:
        async with envoy_rig(tmp_path, edit=rig_edit([port], log_port)) as rig:
            yield SplitRig(rig, backend, port, logs)
    finally:
        await backend.close()


def pieces_at(cut: int) -> list[bytes]:
    return [USAGE[:cut], USAGE[cut:]]


# Byte positions of interest in the usage event: inside `data:`, right after it, inside `"choices":[]`,
# before the first newline, between the two newlines.
CUTS = {"d|ata": 1, "dat|a": 3, "data: |": 6, "[|]": USAGE.index(b"[]") + 1, "|\\n\\n": len(USAGE) - 2,
        "\\n|\\n": len(USAGE) - 1}


async def run(split: SplitRig, usage_pieces: list[bytes], rid: str, *, drop_usage: bool = True,
              tail: bytes = DONE) -> bytes:
    """CONTENT then the usage event in `usage_pieces`, each its own chunk to Envoy, then `tail`. The
    first usage piece travels with CONTENT; the backend goes on only once the client has CONTENT, so
    a complete event that Envoy held back fails here (timeout)."""
    seen_content = asyncio.Event()

    async def reply(_request: BackendRequest, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + chunk(CONTENT + usage_pieces[0]))
        await writer.drain()
        async with asyncio.timeout(5):
            await seen_content.wait()
        read = await split.rig.stat(RX_BYTES)
        for piece in usage_pieces[1:]:
            framed = chunk(piece)
            writer.write(framed)
            await writer.drain()
            read += len(framed)
            await split.envoy_read(read)  # so the next piece is a chunk of its own
        writer.write(chunk(tail) + LAST_CHUNK)

    split.backend.reply = reply
    split.route(rid, drop_usage=drop_usage)

    def on_piece(body: bytes) -> None:
        if CONTENT in body:
            seen_content.set()

    got = await stream_post(split.rig.listen, BODY, [("authorization", "Bearer k")], on_piece)
    assert got.status == 200
    return got.body


@pytest.mark.parametrize("cut", list(CUTS.values()), ids=list(CUTS))
async def test_a_usage_event_split_in_two_never_reaches_the_client_and_is_still_reported(
        split: SplitRig, cut: int) -> None:
    body = await run(split, pieces_at(cut), f"cut-{cut}")
    assert body == CONTENT + DONE
    report = await split.report(f"cut-{cut}")
    assert report.usage == EXPECTED_USAGE and report.sent and report.status == 200


async def test_a_usage_event_written_one_byte_at_a_time_never_reaches_the_client(split: SplitRig) -> None:
    body = await run(split, [b"", *(USAGE[i:i + 1] for i in range(len(USAGE)))], "bytes")
    assert body == CONTENT + DONE
    assert (await split.report("bytes")).usage == EXPECTED_USAGE


async def test_a_crlf_usage_event_split_between_its_line_ends_is_dropped(split: SplitRig) -> None:
    crlf = USAGE[:-2] + b"\r\n\r\n"
    body = await run(split, [crlf[:-2], crlf[-2:]], "crlf", tail=b"data: [DONE]\r\n\r\n")
    assert body == CONTENT + b"data: [DONE]\r\n\r\n"


async def test_a_client_that_asked_for_usage_gets_the_split_event_whole(split: SplitRig) -> None:
    body = await run(split, pieces_at(CUTS["\\n|\\n"]), "kept", drop_usage=False)
    assert body == CONTENT + USAGE + DONE
    assert (await split.report("kept")).usage == EXPECTED_USAGE


async def test_an_incomplete_event_at_the_end_of_the_stream_goes_out_as_it_is(split: SplitRig) -> None:
    # The stream ends inside an event (no blank line after it): what was held is flushed, not lost.
    unfinished = b'data: {"choices":[{"index":0,"delta":{"content":"end"}}]}\n'
    body = await run(split, pieces_at(CUTS["d|ata"]), "tail", tail=unfinished)
    assert body == CONTENT + unfinished
