"""Overload through real Envoy, ext_proc, xDS and a tiny simulator (256 tokens of KV), with the
openai SDK: a request that does not fit waits in ext_proc and is served once room frees, still
streaming chunk by chunk; a short request passes a queued one that does not fit (backfill); a
declared batch limit queues a request the KV would fit; a client
that leaves while queued is dropped at once and every count returns to 0; a request that waits
past the queue's TTL gets the JSON 429 with Retry-After."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.stack import API_KEY, Stack, running_stack, wait_until

pytestmark = pytest.mark.e2e

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
KV_TOKENS = 16 * 16
TTL = 1.5
BACKFILL = 1.4  # a request that does not fit may be passed this long (longer than the default: CI is slow)
SLOTS = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    def edit(data: dict[str, Any], _sims: object) -> None:
        data["tenants"][0]["max_in_flight"] = 4
        data["tenants"][0]["priorities_allowed"] = ["batch"]
        data["queue"] = {"ttl_seconds": TTL, "retry_after_seconds": 2, "backfill_seconds": BACKFILL}
        data["routing"] = {"scrape": {"interval_seconds": 0.2}}
        data["models"][0]["max_num_seqs"] = SLOTS  # declared: below the simulator's own limit (64)

    run_dir: Path = tmp_path_factory.mktemp("overload")
    # One backend with room for 256 tokens, at half speed: ~12 ms a token.
    sim_args = ("--speed", "0.5", "--num-gpu-blocks", "16", "--block-size", "16", "--max-model-len", "256")
    with running_stack(run_dir, backends=1, sim_args=sim_args, edit_config=edit) as s:
        # The scraper has read the backend's KV capacity (vllm:cache_config_info).
        wait_until(lambda: s.metric("modeldock_picker_kv_capacity_tokens") == KV_TOKENS, 15, what="KV capacity read")
        yield s


def _idle(stack: Stack) -> bool:
    return (stack.in_flight() == 0 and stack.metric("modeldock_queue_length") == 0
            and stack.metric("modeldock_admission_in_flight") == 0
            and stack.metric("modeldock_picker_committed_tokens") == 0)


class Stream(threading.Thread):
    """One streamed completion in a thread: chunk arrival times and the text, or the error."""

    def __init__(self, stack: Stack, max_tokens: int, timeout: float = 30.0,
                 messages: list[ChatCompletionMessageParam] = MSG) -> None:
        super().__init__(daemon=True)
        self.messages = messages
        self.client = stack.openai(timeout=timeout)
        self.max_tokens = max_tokens
        self.sent = 0.0
        self.times: list[float] = []
        self.text = ""
        self.error: Exception | None = None

    def run(self) -> None:
        self.sent = time.monotonic()
        try:
            stream = self.client.chat.completions.create(model="demo-model", messages=self.messages, stream=True,
                                                         max_tokens=self.max_tokens)
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    self.times.append(time.monotonic())
                    self.text += chunk.choices[0].delta.content
        except Exception as exc:  # noqa: BLE001 (recorded for the test to check)
            self.error = exc


async def _leave_once_queued(stack: Stack, max_tokens: int) -> None:
    """Send a completion with the async openai client and cancel it (closing its connection) once
    the queue holds it: a client that leaves while queued, at a moment the test controls."""
    client = openai.AsyncOpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0)
    call = asyncio.ensure_future(client.chat.completions.create(model="demo-model", messages=MSG,
                                                                max_tokens=max_tokens))
    try:
        queued = asyncio.ensure_future(asyncio.to_thread(
            wait_until, lambda: stack.metric("modeldock_queue_length") == 1, TTL - 0.3, what="the leaver queued"))
        await asyncio.wait([call, queued], return_when=asyncio.FIRST_COMPLETED)
        assert not call.done(), "the request was answered before it could leave"
        await queued  # raises if it never queued
    finally:
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await client.close()


@pytest.mark.timeout(60)
def test_a_queued_request_is_served_once_room_frees_and_streams_chunk_by_chunk(stack: Stack) -> None:
    wait_until(lambda: _idle(stack), 10, what="idle gateway")
    dispatched = stack.metric("modeldock_queue_dispatched_total")
    first = Stream(stack, 90)  # ~95 tokens, ~1.1 s
    first.start()
    wait_until(lambda: stack.in_flight() == 1, 10, what="first request in flight")
    # A ~102-token prompt and 140 of output: 95 + 242 > 256 committed; and while the first may still
    # run (90 steps) both grow by as much, 95 + 102 + 89 > 256: it waits until the first is done (a
    # short prompt would fit beside it: the first is gone before the second has grown).
    second = Stream(stack, 140, messages=[{"role": "user", "content": "hello " * 66}])
    second.start()
    wait_until(lambda: stack.metric("modeldock_queue_length") == 1, 5, what="second request queued")
    assert stack.in_flight() == 1  # queued, not sent: nothing counted on the backend for it
    first.join(20)
    second.join(30)
    assert first.error is None and second.error is None
    assert stack.metric("modeldock_queue_dispatched_total") == dispatched + 1
    # It waited for the first to end, then streamed: many chunks, spread over the generation.
    assert second.times[0] >= first.times[-1]
    assert len(second.times) >= 120
    assert second.times[-1] - second.times[0] > 1.0
    gaps = [b - a for a, b in zip(second.times, second.times[1:], strict=False)]
    assert max(gaps) < 1.0
    wait_until(lambda: _idle(stack), 10, what="every count back to 0")
    log = (stack.run_dir / "extproc.log").read_text()
    assert "in the queue of model demo-model" in log


@pytest.mark.timeout(60)
def test_a_short_request_joins_a_long_generation_whose_limit_leaves_no_room_for_both(stack: Stack) -> None:
    # 205 + 65 committed > 256, but while the short one produces its 60 tokens the long one grows by
    # at most 60: the batch never outgrows the cache, so it is sent at once, not queued.
    wait_until(lambda: _idle(stack), 10, what="idle gateway")
    dispatched = stack.metric("modeldock_queue_dispatched_total")
    preempted = stack.metric("vllm:num_preemptions_total", port=stack.sims[0].port)
    first = Stream(stack, 200)
    first.start()
    wait_until(lambda: stack.in_flight() == 1, 10, what="first request in flight")
    wait_until(lambda: len(first.times) >= 5, 10, what="the long one streaming")
    time.sleep(0.5)  # a fresh sample shows it running (scrape every 0.2 s)
    short = Stream(stack, 60)
    short.start()
    short.join(20)
    assert short.error is None and len(short.times) >= 50
    assert first.is_alive()  # served beside the long one, not after it
    assert stack.metric("modeldock_queue_dispatched_total") == dispatched  # never queued
    first.join(20)
    assert first.error is None
    assert stack.metric("vllm:num_preemptions_total", port=stack.sims[0].port) == preempted  # nothing preempted
    wait_until(lambda: _idle(stack), 10, what="every count back to 0")


@pytest.mark.timeout(60)
def test_the_declared_batch_limit_keeps_a_third_request_in_the_gateway(stack: Stack) -> None:
    # Three requests sent together fit the KV together (3 x ~72 tokens < 256), but the model's entry
    # declares max_num_seqs 2: the last to arrive waits in the gateway's queue, not in the backend's,
    # from the first pick on (nothing was learned), and goes once one of the others ends.
    wait_until(lambda: _idle(stack), 10, what="idle gateway")
    dispatched = stack.metric("modeldock_queue_dispatched_total")
    streams = [Stream(stack, 70) for _ in range(SLOTS + 1)]
    for s in streams:
        s.start()
    wait_until(lambda: stack.metric("modeldock_queue_length") == 1, 10, what="one request queued")
    assert stack.in_flight() == SLOTS
    assert stack.metric("vllm:num_requests_waiting", port=stack.sims[0].port) == 0
    for s in streams:
        s.join(20)
        assert s.error is None and len(s.times) >= 60
    last = max(streams, key=lambda s: s.times[0])  # the queued one: its first token came last
    assert last.times[0] >= min(s.times[-1] for s in streams if s is not last)  # after another ended
    assert stack.metric("modeldock_queue_dispatched_total") == dispatched + 1
    wait_until(lambda: _idle(stack), 10, what="every count back to 0")


@pytest.mark.timeout(60)
def test_a_short_request_passes_a_queued_one_that_does_not_fit(stack: Stack) -> None:
    # The first (~205 tokens, ~2.4 s) runs; the second (~204) cannot join it (both may grow to
    # 409 > 256) and waits, past its 1.5 s TTL; a short one behind it (~15) fits beside the first:
    # it is backfilled and served while the second still waits.
    wait_until(lambda: _idle(stack), 10, what="idle gateway")
    dispatched = stack.metric("modeldock_queue_dispatched_total")
    backfilled = stack.metric("modeldock_queue_backfilled_total")
    first = Stream(stack, 200)
    first.start()
    wait_until(lambda: stack.in_flight() == 1, 10, what="first request in flight")
    second = Stream(stack, 199)
    second.start()
    wait_until(lambda: stack.metric("modeldock_queue_length") == 1, 5, what="second request queued")
    short = Stream(stack, 10)
    short.start()
    short.join(20)
    assert short.error is None and short.text
    assert second.is_alive() and not second.times  # still waiting, nothing streamed yet
    assert first.is_alive()  # served beside the first, not after it
    assert stack.metric("modeldock_queue_backfilled_total") == backfilled + 1
    second.join(20)
    assert isinstance(second.error, openai.RateLimitError)  # its TTL passed while the first ran
    assert second.error.response.json()["error"]["code"] == "queue_timeout"
    first.join(20)
    assert first.error is None
    assert stack.metric("modeldock_queue_dispatched_total") == dispatched + 1  # the short one
    wait_until(lambda: _idle(stack), 10, what="every count back to 0")


@pytest.mark.timeout(60)
def test_a_client_that_leaves_while_queued_is_dropped_at_once(stack: Stack) -> None:
    wait_until(lambda: _idle(stack), 10, what="idle gateway")
    cancelled = stack.metric("modeldock_queue_cancelled_total")
    first = Stream(stack, 200)  # ~2.4 s of generation
    first.start()
    wait_until(lambda: stack.in_flight() == 1, 10, what="first request in flight")
    # ~205 tokens: while it runs the first can grow by that much too, 410 > 256: it waits (a short one
    # would go on: the first cannot grow past the cache before it is done). The client leaves once
    # the request is queued: a task cancelled closes its connection (a client timeout raced the TTL).
    asyncio.run(_leave_once_queued(stack, max_tokens=199))
    wait_until(lambda: stack.metric("modeldock_queue_cancelled_total") == cancelled + 1, 5,
               what="the queue dropped the request")
    assert stack.metric("modeldock_queue_length") == 0
    assert stack.metric("modeldock_admission_in_flight") == 1  # the first one's slot only
    assert first.is_alive() and stack.in_flight() == 1
    first.join(20)
    assert first.error is None
    wait_until(lambda: _idle(stack), 10, what="every count back to 0")
    backend = stack.sims[0].requests()
    assert backend and not any((r["body"] or {}).get("max_tokens") == 199 for r in backend)  # never sent


@pytest.mark.timeout(60)
def test_ttl_expiry_gives_the_json_429_with_retry_after(stack: Stack) -> None:
    wait_until(lambda: _idle(stack), 10, what="idle gateway")
    first = Stream(stack, 200)
    first.start()
    wait_until(lambda: stack.in_flight() == 1, 10, what="first request in flight")
    client = stack.openai()
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="demo-model", messages=MSG, max_tokens=199)
    waited = time.monotonic() - started
    assert TTL <= waited < TTL + 1.0
    error = caught.value
    assert error.status_code == 429
    assert error.response.headers["retry-after"] == "2"
    body = error.response.json()["error"]
    assert body["code"] == "queue_timeout" and body["type"] == "rate_limit_error"
    assert set(body) == {"message", "type", "param", "code"}
    first.join(20)
    assert first.error is None
    wait_until(lambda: _idle(stack), 10, what="every count back to 0")


@pytest.mark.timeout(30)
def test_priority_header_reaches_ext_proc_and_never_the_backend(stack: Stack) -> None:
    wait_until(lambda: _idle(stack), 10, what="idle gateway")
    client = stack.openai()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="demo-model", messages=MSG, max_tokens=3,
                                       extra_headers={"x-priority": "interactive"})
    assert caught.value.response.json()["error"]["code"] == "priority_not_allowed"
    reply = client.chat.completions.create(model="demo-model", messages=MSG, max_tokens=7,
                                           extra_headers={"x-priority": "batch"})
    assert reply.choices[0].message.content
    last = stack.sims[0].requests()[-1]
    assert last["body"]["max_tokens"] == 7
    assert not any(name.lower() == "x-priority" for name, _ in last["headers"])
