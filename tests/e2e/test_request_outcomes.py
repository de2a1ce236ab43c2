"""What Envoy 1.40's usage log entry says about how a request ended, read through `usage_reports`.

The settlement charges a request whose body reached a backend (issue 26, hole 4: vLLM sends a
non-streaming response's headers only after generating, so "a backend answered" is not the test),
and the usage record names the termination cause. Each test runs the real bootstrap (`envoy_rig`)
with scripted backends (the rig's own upstreams closed, so the fallback policy finds nothing) and
pins the entry's fields for one outcome; docs/envoy.md lists the facts.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from envoy.data.accesslog.v3 import accesslog_pb2

from modeldock.budgets.tokens import Usage
from modeldock.config import ListenerConfig
from modeldock.extproc import responses
from modeldock.extproc.attempts import usage_reports
from modeldock.gateway.settlement import UsageReport
from modeldock.types import cluster_name
from modeldock.up import free_port
from tests.support.access_log import AccessLogCollector, access_log_server
from tests.support.envoy_rig import BODY, Rig, envoy_rig
from tests.support.extproc_messages import usage_log_message
from tests.support.scripted_backend import (
    LAST_CHUNK,
    SSE_HEAD,
    BackendRequest,
    Reply,
    ScriptedBackend,
    chunk,
    json_reply,
    rig_edit,
    stream_post,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

OK_JSON = (b'{"choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}],'
           b'"usage":{"prompt_tokens":30,"completion_tokens":4,"prompt_tokens_details":{"cached_tokens":16}}}')
ERROR_JSON = b'{"error":{"message":"boom"}}'
CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'


async def hang(_request: BackendRequest, _writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)  # generating: the handler is cancelled when the test ends


async def close_at_once(_request: BackendRequest, _writer: asyncio.StreamWriter) -> None:
    return  # the body was read; the connection closes without a byte


async def answer_500(_request: BackendRequest, writer: asyncio.StreamWriter) -> None:
    writer.write(json_reply(500, ERROR_JSON))


async def answer_503(_request: BackendRequest, writer: asyncio.StreamWriter) -> None:
    writer.write(json_reply(503, ERROR_JSON))


async def answer_ok(_request: BackendRequest, writer: asyncio.StreamWriter) -> None:
    writer.write(json_reply(200, OK_JSON))


async def one_event_then_close(_request: BackendRequest, writer: asyncio.StreamWriter) -> None:
    writer.write(SSE_HEAD + chunk(CONTENT))


async def one_event_then_silence(_request: BackendRequest, writer: asyncio.StreamWriter) -> None:
    writer.write(SSE_HEAD + chunk(CONTENT))
    await writer.drain()
    await asyncio.sleep(30)


@dataclass
class Outcome:
    rig: Rig
    backends: list[ScriptedBackend]
    logs: AccessLogCollector

    async def entry(self, rid: str) -> accesslog_pb2.HTTPAccessLogEntry:
        heard = await self.logs.wait_for(lambda e: e.common_properties.metadata.filter_metadata[
            "modeldock"].fields["rid"].string_value == rid)
        return heard.entry

    async def report(self, rid: str) -> UsageReport:
        message = usage_log_message()
        message.http_logs.log_entry.add().CopyFrom(await self.entry(rid))
        (report,) = usage_reports(message)
        return report


@asynccontextmanager
async def outcome(tmp_path: Path, replies: list[Reply], *, refusing: int = 0, rid: str,
                  listener: ListenerConfig | None = None, usage: bool = True) -> AsyncIterator[Outcome]:
    """Backends answering with `replies` (tried in this order), after `refusing` ports nobody listens on;
    `usage`: the route marks the request as needing its usage (`modeldock:usage`)."""
    async with access_log_server() as (logs, log_port):
        backends = [ScriptedBackend(reply) for reply in replies]
        try:
            ports = [free_port() for _ in range(refusing)] + [await b.start() for b in backends]
            async with envoy_rig(tmp_path, listener=listener, edit=rig_edit(ports, log_port)) as rig:
                rig.upstream.close()  # the rig's own upstreams refuse too: no fallback answers
                endpoints = ",".join(f"127.0.0.1:{p}" for p in ports)
                rig.extproc.answer = lambda _r: responses.route_request_body(
                    cluster_name("m"), endpoints, model="m", rid=rid, usage=usage)
                yield Outcome(rig, backends, logs)
        finally:
            for backend in backends:
                await backend.close()


async def post(rig: Rig) -> tuple[int, bytes]:
    got = await stream_post(rig.listen, BODY, [("authorization", "Bearer k")])
    return got.status, got.body


async def test_a_client_leaving_before_the_response_headers_was_sent_to_the_backend(tmp_path: Path) -> None:
    async with outcome(tmp_path, [hang], rid="left") as o:
        client = asyncio.ensure_future(post(o.rig))
        async with asyncio.timeout(5):
            while not o.backends[0].received:
                await asyncio.sleep(0.005)
        client.cancel()  # the backend is generating; no header has come back
        await asyncio.gather(client, return_exceptions=True)
        entry = await o.entry("left")
        report = await o.report("left")
    assert entry.response.upstream_header_bytes_received == 0 and entry.common_properties.upstream_wire_bytes_sent > 0
    assert report.sent and not report.reached_backend and report.cancelled and report.status == 0
    assert not (report.timed_out or report.upstream_failed or report.backend_error)
    assert report.response_bytes == 0


async def test_a_connection_refused_on_every_endpoint_sent_nothing(tmp_path: Path) -> None:
    async with outcome(tmp_path, [], refusing=2, rid="refused") as o:
        status, body = await post(o.rig)
        report = await o.report("refused")
    assert status == 503 and b"upstream_unavailable" in body
    assert not report.sent and not report.reached_backend and report.upstream_failed and not report.backend_error
    assert report.attempts == 3 and report.response_bytes == len(body)  # Envoy's own JSON reply


async def test_backends_closing_after_reading_the_body_were_sent_it(tmp_path: Path) -> None:
    # Two backends read the body and close; the third attempt (the fallback) is refused. The wire bytes
    # count every attempt, while the last-attempt timings (time_to_last_upstream_tx_byte) are of the
    # refused one: the wire bytes are the field that says the body reached a backend.
    async with outcome(tmp_path, [close_at_once, close_at_once], rid="reset") as o:
        status, _ = await post(o.rig)
        entry = await o.entry("reset")
        report = await o.report("reset")
    assert status == 503 and all(b.received for b in o.backends)
    assert not entry.common_properties.HasField("time_to_last_upstream_tx_byte")
    assert report.sent and not report.reached_backend and report.upstream_failed and not report.backend_error


async def test_a_backends_500_is_a_backend_error(tmp_path: Path) -> None:
    async with outcome(tmp_path, [answer_500], rid="500") as o:
        status, body = await post(o.rig)
        report = await o.report("500")
    assert (status, body) == (500, ERROR_JSON)
    assert report.sent and report.reached_backend and report.backend_error and report.attempts == 1
    assert not (report.upstream_failed or report.timed_out) and report.response_bytes == len(ERROR_JSON)


async def test_a_503_on_every_attempt_is_the_backends_error(tmp_path: Path) -> None:
    # Envoy passes the last 503 on (details via_upstream) and adds only the retry-limit flag (URX).
    async with outcome(tmp_path, [answer_503, answer_503, answer_503], rid="503s") as o:
        status, _ = await post(o.rig)
        entry = await o.entry("503s")
        report = await o.report("503s")
    assert status == 503 and entry.common_properties.response_flags.upstream_retry_limit_exceeded
    assert report.backend_error and not report.upstream_failed and report.attempts == 3


async def test_a_retry_onto_a_second_endpoint_reports_its_usage_with_cached_tokens(tmp_path: Path) -> None:
    async with outcome(tmp_path, [answer_503, answer_ok], rid="retry") as o:
        status, body = await post(o.rig)
        report = await o.report("retry")
    assert (status, body) == (200, OK_JSON)
    assert report.usage == Usage(30, 4, 16)  # json_to_metadata copied prompt_tokens_details.cached_tokens
    assert report.sent and report.attempts == 2 and report.endpoint == f"127.0.0.1:{o.backends[1].port}"
    assert not (report.backend_error or report.upstream_failed or report.timed_out)


async def test_a_stream_cut_after_it_started_is_an_upstream_failure_with_what_was_streamed(tmp_path: Path) -> None:
    async with outcome(tmp_path, [one_event_then_close], rid="cut") as o:
        with pytest.raises(asyncio.IncompleteReadError):
            await post(o.rig)  # Envoy closes the client's connection without the last chunk
        report = await o.report("cut")
    assert report.status == 200 and report.upstream_failed and not report.backend_error
    assert report.response_bytes == len(CONTENT)


@pytest.mark.parametrize(("reply", "streamed"), [(hang, 0), (one_event_then_silence, len(CONTENT))],
                         ids=["before-headers", "mid-stream"])
async def test_a_silent_backend_times_out(tmp_path: Path, reply: Reply, streamed: int) -> None:
    async with outcome(tmp_path, [reply], rid="idle", listener=ListenerConfig(stream_idle_timeout_seconds=0.3)) as o:
        answer: tuple[int, bytes] | None = None
        try:
            answer = await post(o.rig)
        except asyncio.IncompleteReadError:
            pass  # cut mid-stream
        report = await o.report("idle")
    assert report.timed_out and report.sent and not report.upstream_failed and not report.backend_error
    if streamed:
        assert report.response_bytes == streamed and answer is None
    else:
        # Before the headers the client gets Envoy's reply as a JSON 504 saying what happened: the backend
        # took the request and went silent (not "no endpoint could take it").
        assert answer is not None and answer[0] == 504
        error = json.loads(answer[1])["error"]
        assert error["code"] == "upstream_timeout" and "model `m`" in error["message"]
        assert report.status == 504


USAGE_EVENT = b'data: {"choices":[],"usage":{"prompt_tokens":30,"completion_tokens":4}}\n\n'
USAGE_FILTER_STATS = ("http.modeldock.lua.executions", "sse_to_metadata.resp.json.metadata_added",
                      "sse_to_metadata.resp.json.parse_error")


async def marks_itself(_request: BackendRequest, writer: asyncio.StreamWriter) -> None:
    # A backend claiming the usage mark the usage filters are gated on (modeldock.envoy.USAGE_MARK_HEADER).
    head = SSE_HEAD.replace(b"\r\n\r\n", b"\r\nx-modeldock-usage: 1\r\n\r\n")
    writer.write(head + chunk(CONTENT) + chunk(USAGE_EVENT) + LAST_CHUNK)


async def test_a_backend_cannot_turn_the_usage_filters_on(tmp_path: Path) -> None:
    # The route removes the mark a backend sends before it adds its own from `modeldock:usage`: a request
    # that needs no usage passes none of the usage filters, and the client never sees the header.
    async with outcome(tmp_path, [marks_itself], rid="forged", usage=False) as o:
        before = [await o.rig.stat(name) for name in USAGE_FILTER_STATS]
        got = await stream_post(o.rig.listen, BODY, [("authorization", "Bearer k")])
        after = [await o.rig.stat(name) for name in USAGE_FILTER_STATS]
    assert got.status == 200 and USAGE_EVENT in got.body  # passed through whole, read by nothing
    assert "x-modeldock-usage" not in got.headers
    assert after == before
