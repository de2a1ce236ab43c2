"""What the Envoy bootstrap itself defends: slow and idle clients, memory, headers in and out,
retries, and ext_proc going away. Real Envoy on the rendered bootstrap (tests/support/envoy_rig.py),
raw sockets where a client must misbehave. See docs/envoy.md.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from modeldock.config import ListenerConfig
from tests.support.envoy_rig import BODY, Reply, Rig, envoy_rig, route
from tests.support.stack import Stack, running_stack, wait_until

MSG = [{"role": "user", "content": "Tell me a long story."}]

pytestmark = pytest.mark.e2e

SHORT = ListenerConfig(request_headers_timeout_seconds=1, request_timeout_seconds=1.5, idle_timeout_seconds=1,
                       stream_idle_timeout_seconds=30, max_concurrent_streams=7)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with envoy_rig(tmp_path, SHORT) as running:
        yield running


async def trickle(port: int, head: bytes, drip: bytes, every: float, limit: float) -> tuple[float, bytes]:
    """Send `head`, then one byte of `drip` every `every` s; the seconds until Envoy closes, and what it said."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    writer.write(head)
    received = b""

    async def drip_bytes() -> None:
        for byte in drip:
            await asyncio.sleep(every)
            writer.write(bytes([byte]))
            await writer.drain()

    dripping = asyncio.create_task(drip_bytes())
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), limit):
            received += chunk
    except ConnectionError:
        pass
    finally:
        dripping.cancel()
        writer.close()
    return time.monotonic() - started, received


def status_and_error(raw: bytes) -> tuple[int, str]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]["code"]


async def test_headers_sent_slowly_are_cut_at_the_headers_timeout(rig: Rig) -> None:
    took, said = await trickle(rig.listen, b"POST /v1/chat/completions HTTP/1.1\r\n", b"x-slow: " + b"a" * 100,
                               every=0.1, limit=10)
    assert 0.9 < took < 3, took
    assert status_and_error(said) == (408, "request_timeout")


async def test_a_body_sent_slowly_is_cut_at_the_request_timeout(rig: Rig) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n"
    took, said = await trickle(rig.listen, head, b"{" * 100, every=0.1, limit=10)
    assert 1.4 < took < 3.5, took
    assert status_and_error(said) == (408, "request_timeout")
    assert not rig.extproc.streams and not rig.upstream.received


async def test_the_request_timeout_does_not_bound_a_long_response(rig: Rig) -> None:
    rig.upstream.reply_seconds = 2.5  # well past request_timeout (1.5 s)
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    r = await rig.post()
    assert (r.status_code, r.text) == (200, "okend")


async def test_a_silent_connection_is_closed_at_the_idle_timeout(rig: Rig) -> None:
    took, said = await trickle(rig.listen, b"", b"", every=0, limit=10)
    assert 0.9 < took < 3 and said == b"", (took, said)
    # After a request on a kept-alive connection, the idle timeout starts Envoy's drain of the
    # connection, which closes it drain_timeout (5 s, Envoy's default) later.
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\nauthorization: Bearer k\r\n"
               b"content-length: %d\r\n\r\n" % len(BODY) + BODY)
    took, said = await trickle(rig.listen, request, b"", every=0, limit=10)
    assert said.startswith(b"HTTP/1.1 200") and said.endswith(b"0\r\n\r\n") and 5.9 < took < 8.5, (took, said)


def h2_settings(port: int) -> dict[int, int]:
    """The SETTINGS Envoy sends a cleartext HTTP/2 client (prior knowledge)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + struct.pack(">I", 0)[1:] + b"\x04\x00" + b"\x00\x00\x00\x00")
        data = b""
        while len(data) < 9 or len(data) < 9 + int.from_bytes(data[:3], "big"):
            chunk = sock.recv(65536)
            assert chunk, "Envoy closed the HTTP/2 connection"
            data += chunk
    length, kind = int.from_bytes(data[:3], "big"), data[3]
    assert kind == 4, "the server's first frame is SETTINGS"
    payload = data[9:9 + length]
    return {struct.unpack(">H", payload[i:i + 2])[0]: struct.unpack(">I", payload[i + 2:i + 6])[0]
            for i in range(0, length, 6)}


async def test_http2_clients_get_bounded_streams_and_windows(rig: Rig) -> None:
    settings = await asyncio.to_thread(h2_settings, rig.listen)
    assert settings[0x3] == 7  # SETTINGS_MAX_CONCURRENT_STREAMS, from listener.max_concurrent_streams
    assert settings[0x4] == 65536  # SETTINGS_INITIAL_WINDOW_SIZE


async def test_the_overload_manager_refuses_requests_past_the_heap_limit(tmp_path: Path) -> None:
    # Envoy's own heap is above 1 MiB from the start: every action is on.
    async with envoy_rig(tmp_path, ListenerConfig(max_heap_bytes=1024 * 1024)) as tight:
        for _ in range(100):
            if await tight.stat("overload.envoy.overload_actions.stop_accepting_requests.active") == 1:
                break
            await asyncio.sleep(0.05)
        tight.extproc.answer = route(f"127.0.0.1:{tight.ports[0]}")
        r = await tight.post()
        assert (r.status_code, r.error()["code"], r.headers["retry-after"]) == (503, "gateway_overloaded", "1")
        assert not tight.upstream.received and not tight.extproc.streams
        assert await tight.stat("overload.envoy.overload_actions.shrink_heap.active") == 1
        assert await tight.stat("overload.envoy.overload_actions.disable_http_keepalive.active") == 1


async def test_credentials_and_internal_headers_never_reach_the_backend(rig: Rig) -> None:
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    sent = [("authorization", "Bearer k"), ("proxy-authorization", "Basic k"), ("api-key", "k"), ("x-api-key", "k"),
            ("cookie", "session=k"), ("x-modeldock-tenant", "other"), ("x-modeldock-cluster", "modeldock_extproc"),
            ("x-gateway-destination-endpoint", f"127.0.0.1:{rig.ports[1]}"), ("x-envoy-original-path", "/admin"),
            ("x-envoy-max-retries", "5"), ("x_api_key", "k"), ("x-request-id", "req-1"), ("x-kept", "1")]
    r = await rig.post(headers=sent)
    assert (r.status_code, r.text) == (200, "okend")
    got = rig.upstream.received[-1]
    assert got.port == rig.ports[0]
    assert not [k for k in got.headers if "api" in k or "auth" in k or k == "cookie" or k.startswith("x-modeldock")
                or "_" in k], got.headers
    # Envoy's own: the attempt count it sets upstream, and the client's request id.
    assert [k for k in got.headers if k.startswith("x-envoy")] == ["x-envoy-attempt-count"]
    assert got.headers["x-request-id"] == "req-1" and got.headers["x-kept"] == "1"
    # Nothing in the response says what serves the API.
    assert "server" not in r.headers and not [k for k in r.headers if k.startswith("x-envoy")], r.headers
    assert "tenant=- " in (await rig.access_log())[-1] and "Bearer" not in rig.log.read_text()


async def test_a_client_cannot_steer_envoys_router(rig: Rig) -> None:
    # Without the prefix strip, the router honours these from a client it deems internal.
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    r = await rig.post(headers=[("authorization", "Bearer k"), ("x-envoy-upstream-rq-timeout-ms", "1")])
    assert (r.status_code, r.text) == (200, "okend")
    rig.upstream.modes = {port: "503" for port in rig.ports}
    r = await rig.post(headers=[("authorization", "Bearer k"), ("x-envoy-max-retries", "0"),
                                ("x-envoy-retry-on", "5xx")])
    assert r.status_code == 503
    assert len(rig.upstream.received) == 1 + 3  # num_retries 2 stands


async def attempts(rig: Rig, primary: str) -> tuple[Reply, list[int]]:
    """One request onto the primary with the other port as fallback; the ports it reached."""
    rig.upstream.modes[rig.ports[0]] = primary
    before = len(rig.upstream.received)
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]},127.0.0.1:{rig.ports[1]}")
    r = await rig.post()
    return r, [got.port for got in rig.upstream.received[before:]]


@pytest.mark.parametrize(("primary", "retried"), [("503", True), ("reset", True), ("500", False)])
async def test_which_failures_are_retried_on_the_fallback(rig: Rig, primary: str, retried: bool) -> None:
    r, reached = await attempts(rig, primary)
    if retried:
        assert (r.status_code, r.text, reached) == (200, "okend", rig.ports)
    else:
        assert (r.status_code, reached) == (500, rig.ports[:1])


async def test_a_refused_connection_is_retried_on_the_fallback(rig: Rig) -> None:
    rig.upstream.servers[0].close()
    await asyncio.sleep(0.05)
    r, reached = await attempts(rig, "ok")
    assert (r.status_code, r.text, reached) == (200, "okend", rig.ports[1:])


async def test_no_retry_once_the_response_has_started_and_the_log_says_it_was_cut(rig: Rig) -> None:
    r, reached = await attempts(rig, "cut")
    # The client has its 200 and the first chunk, then the connection closes; no second attempt.
    assert (r.status_code, r.text, reached) == (200, "ok", rig.ports[:1])
    (line,) = await rig.access_log()
    flags = line.partition("flags=")[2].split()[0]
    details = line.partition("details=")[2].split()[0]
    # Over HTTP/1.1 a chunked body closed early is a protocol error (UPE); a reset would say UR or UC.
    assert " 200 " in line and flags in ("UPE", "UC", "UR"), line
    assert details.startswith("upstream_reset_after_response_started"), line
    # A completed stream, for contrast.
    r, _ = await attempts(rig, "ok")
    assert r.text == "okend", r
    last = (await rig.access_log(2))[-1]
    assert "flags=- details=via_upstream " in last, last


async def test_an_admitted_stream_outlives_ext_proc(rig: Rig) -> None:
    rig.upstream.reply_seconds = 1.5
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    streaming = asyncio.create_task(rig.post())
    for _ in range(100):
        if rig.upstream.received:
            break
        await asyncio.sleep(0.02)
    await rig.server.stop(None)  # ext_proc gone, its streams cut
    r = await streaming
    assert (r.status_code, r.text) == (200, "okend")
    # Not admitted yet: a JSON 503, never upstream, whatever the client claims.
    r = await rig.post(headers=[("authorization", "Bearer k"), ("x-modeldock-cluster", "modeldock_extproc"),
                                ("x-gateway-destination-endpoint", f"127.0.0.1:{rig.ports[0]}")])
    assert (r.status_code, r.error()["code"], r.headers["retry-after"]) == (503, "gateway_unavailable", "1")
    r = await rig.post(body=None, method="GET", path="/v1/models")
    assert (r.status_code, r.error()["code"]) == (503, "gateway_unavailable")
    assert len(rig.upstream.received) == 1
    assert await rig.stat("http.modeldock.ext_proc.failure_mode_allowed") >= 2


# ---- the whole stack: ext_proc killed under load ---------------------------------------------------------


def _stream(stack: Stack, started: threading.Event, max_tokens: int) -> tuple[int, str | None]:
    chunks, finish = 0, None
    for chunk in stack.openai().chat.completions.create(model="demo-model", messages=MSG, max_tokens=max_tokens,
                                                        stream=True):
        chunks += 1
        started.set()
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return chunks, finish


def _scores(stack: Stack, port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()  # noqa: S310
    return {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("modeldock_picker_score{")}


@pytest.mark.timeout(180)
def test_streams_survive_ext_proc_being_killed_and_a_restart_relearns_the_load(tmp_path: Path) -> None:
    with running_stack(tmp_path, backends=2, sim_args=("--step-base-ms", "20", "--speed", "1")) as stack:
        extproc = next(c for c in stack.sup.children if c.name == "extproc")
        events = [threading.Event() for _ in range(4)]
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_stream, stack, e, 300) for e in events]
            assert all(e.wait(20) for e in events), "every stream has started"
            extproc.proc.kill()  # SIGKILL: no drain, every ext_proc stream cut
            extproc.proc.wait()
            # Not admitted yet: nothing can check it, so a JSON 503, never a backend.
            before = sum(len(sim.requests()) for sim in stack.sims)
            with pytest.raises(openai.InternalServerError) as refused:
                stack.openai().chat.completions.create(model="demo-model", messages=MSG, max_tokens=2)
            assert refused.value.status_code == 503
            assert refused.value.body["code"] == "gateway_unavailable"  # type: ignore[index]
            assert sum(len(sim.requests()) for sim in stack.sims) == before
            # A new ext_proc learns the backends' load from their own metrics, not from its in-flight count.
            port = stack.extproc_metrics_ports[0]
            stack.sup.start("extproc-restarted", [str(a) for a in extproc.proc.args])
            wait_until(lambda: _ready_port(port), 30, what="restarted ext_proc")
            wait_until(lambda: len(_scores(stack, port)) == 2, 10, what="scores for both endpoints")
            busy = max(_scores(stack, port).values())
            results = [f.result(timeout=60) for f in futures]
        # Every stream ran to its end, although ext_proc died under it.
        assert all(finish == "length" and chunks > 250 for chunks, finish in results), results
        assert stack.in_flight() == 0  # the new ext_proc never counted them
        wait_until(lambda: max(_scores(stack, port).values()) < busy, 10, what="scores to fall with the load")
        r = stack.openai().chat.completions.create(model="demo-model", messages=MSG, max_tokens=2)
        assert r.choices[0].finish_reason == "length"


def _ready_port(port: int) -> bool:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()  # noqa: S310
    except OSError:
        return False
    return "modeldock_picker_in_flight{" in text
