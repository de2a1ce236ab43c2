"""Picker mode's billing: each request's own key, the director's body forwarded, and the backend's usage
read from the response it passes on and settled with (modeldock/epp/flow.py, usage.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from modeldock.epp import PickerFlow
from modeldock.gateway import Gateway
from modeldock.usage.config import UsageConfig
from modeldock.usage.log import UsageLog
from tests.support.extproc_messages import headers_request, make_gateway, raw_headers
from tests.unit.epp.test_picker_flow import (
    BUFFERED,
    CONFIG,
    A,
    B,
    C,
    chunk,
    mutation,
    run,
    start,
    streamed,
)

BUDGETED = {**CONFIG, "tenants": [{**CONFIG["tenants"][0], "tokens_per_minute": 100_000}]}
STREAMING = json.dumps({"model": "llama-8b", "stream": True, "max_tokens": 50,
                        "messages": [{"role": "user", "content": "hi"}]}).encode()
CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"hello"}}]}\n\n'
USAGE_EVENT = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12}}\n\n'
DONE = b"data: [DONE]\n\n"


def gateway(tmp_path: Path, config: dict[str, Any] = BUDGETED) -> tuple[Gateway, Path]:
    """A gateway with usage records on, written to a file under tmp_path."""
    gw = make_gateway(config, {"llama-8b": [A, B, C]}, seed=1)
    usage = UsageConfig(path=tmp_path / "usage.jsonl", replica="t", fsync_interval_seconds=0)
    gw.usage_log = UsageLog.open(usage, gw.clock, background=False)
    gw.records_on = True
    return gw, usage.active_path()


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def response_headers(content_type: str, *extra: tuple[str, str]) -> ep.ProcessingRequest:
    return headers_request(raw_headers((":status", "200"), ("content-type", content_type), *extra),
                           end_of_stream=False, field="response_headers")


def body(data: bytes, end: bool = False) -> ep.ProcessingRequest:
    return chunk(data, end=end, field="response_body")


async def test_every_request_has_its_own_key_for_its_reservation_and_its_usage_record(tmp_path: Path) -> None:
    gw, path = gateway(tmp_path)
    keys = []
    for _ in range(18):
        flow = PickerFlow(gw)  # one after the other: a finished flow's memory is reused
        await run(flow, start(), chunk(STREAMING))
        assert flow.routed is not None and flow.routed.holdings.reservation is not None
        keys.append(flow.routed.holdings.reservation.request_id)
        flow.finish()
    ids = [r["request_id"] for r in records(path)]
    assert len(set(ids)) == 18 and ids == keys


async def test_the_directors_body_is_forwarded_in_duplex_and_in_buffered(tmp_path: Path) -> None:
    gw, _ = gateway(tmp_path)
    flow = PickerFlow(gw)
    out = await run(flow, start(), chunk(STREAMING[:9], end=False), chunk(STREAMING[9:]))
    assert flow.routed is not None and flow.routed.usage.drop_usage
    sent, _ = streamed(out[1:])
    assert json.loads(sent)["stream_options"] == {"include_usage": True}  # what the director wrote
    assert mutation(out[0].request_headers.response)[0]["content-length"] == str(len(sent))
    flow.finish()
    flow = PickerFlow(gw)
    await flow.handle(start(mode=BUFFERED))
    common = (await flow.handle(chunk(STREAMING)))[0].request_body.response
    assert json.loads(common.body_mutation.body)["stream_options"] == {"include_usage": True}
    assert mutation(common)[0]["content-length"] == str(len(common.body_mutation.body))
    flow.finish()


async def test_a_stream_is_settled_with_its_usage_and_the_usage_event_the_client_did_not_ask_for_is_dropped(
        tmp_path: Path) -> None:
    gw, path = gateway(tmp_path)
    flow = PickerFlow(gw)
    await run(flow, start(), chunk(STREAMING))
    reservation = flow.routed.holdings.reservation if flow.routed is not None else None
    assert reservation is not None and reservation.cost > 12
    await flow.handle(response_headers("text/event-stream"))
    out = [await flow.handle(body(CONTENT + USAGE_EVENT[:25])),
           await flow.handle(body(USAGE_EVENT[25:])),  # the rest of the usage event: nothing to send
           await flow.handle(body(DONE, end=True))]
    assert out[1] == []
    sent, ended = streamed([r for answers in out for r in answers], "response_body")
    assert (sent, ended) == (CONTENT + DONE, True)
    flow.finish()
    assert (reservation.state, reservation.charged) == ("settled", 12)
    [record] = records(path)
    assert (record["prompt_tokens"], record["completion_tokens"], record["token_source"]) == (7, 5, "reported")
    assert record["status"] == 200 and record["request_id"] == flow.rid


async def test_a_client_that_asked_for_usage_gets_it_and_the_request_is_settled_with_it(tmp_path: Path) -> None:
    gw, path = gateway(tmp_path)
    asked = json.loads(STREAMING)
    asked["stream_options"] = {"include_usage": True}
    flow = PickerFlow(gw)
    await run(flow, start(), chunk(json.dumps(asked).encode()))
    assert flow.routed is not None and not flow.routed.usage.drop_usage
    await flow.handle(response_headers("text/event-stream; charset=utf-8"))
    out = [await flow.handle(body(c, end=c is DONE)) for c in (CONTENT, USAGE_EVENT[:25], USAGE_EVENT[25:], DONE)]
    assert all(len(answers) == 1 for answers in out)  # every chunk goes on as it comes
    assert streamed([a for answers in out for a in answers], "response_body")[0] == CONTENT + USAGE_EVENT + DONE
    flow.finish()
    assert records(path)[0]["token_source"] == "reported"


async def test_a_stream_cut_before_its_usage_is_charged_its_whole_reservation(tmp_path: Path) -> None:
    gw, path = gateway(tmp_path)
    flow = PickerFlow(gw)
    await run(flow, start(), chunk(STREAMING))
    reservation = flow.routed.holdings.reservation if flow.routed is not None else None
    assert reservation is not None
    await run(flow, response_headers("text/event-stream"), body(CONTENT + USAGE_EVENT[:30]))
    flow.finish()  # the client went away: the held part of the event never completes
    assert (reservation.state, reservation.charged) == ("charged", reservation.cost)
    assert records(path)[0]["token_source"] == "estimated"


async def test_a_json_response_in_buffered_mode_is_settled_with_its_usage(tmp_path: Path) -> None:
    gw, path = gateway(tmp_path)
    flow = PickerFlow(gw)
    await run(flow, start(mode=BUFFERED), chunk(json.dumps({"model": "llama-8b", "messages": []}).encode()))
    await flow.handle(response_headers("application/json"))
    answer = await flow.handle(body(json.dumps({"choices": [], "usage": {"prompt_tokens": 3,
                                                                         "completion_tokens": 2}}).encode(), True))
    assert answer == [ep.ProcessingResponse(response_body=ep.BodyResponse())]  # passed on unchanged
    flow.finish()
    assert (records(path)[0]["prompt_tokens"], records(path)[0]["completion_tokens"]) == (3, 2)


async def test_a_buffered_stream_loses_the_usage_event_in_a_body_mutation(tmp_path: Path) -> None:
    gw, path = gateway(tmp_path)
    flow = PickerFlow(gw)
    await run(flow, start(mode=BUFFERED), chunk(STREAMING))
    await flow.handle(response_headers("text/event-stream"))
    answer = await flow.handle(body(CONTENT + USAGE_EVENT + DONE, True))
    assert answer[0].response_body.response.body_mutation.body == CONTENT + DONE
    flow.finish()
    assert records(path)[0]["completion_tokens"] == 5


async def test_trailers_end_the_body_and_what_was_held_goes_on_before_their_answer(tmp_path: Path) -> None:
    gw, _ = gateway(tmp_path)
    flow = PickerFlow(gw)
    await run(flow, start(), chunk(STREAMING))
    await flow.handle(response_headers("text/event-stream"))
    assert await flow.handle(body(CONTENT[:10])) == []
    out = await flow.handle(ep.ProcessingRequest(response_trailers=ep.HttpTrailers()))
    assert [r.WhichOneof("response") for r in out] == ["response_body", "response_trailers"]
    assert out[0].response_body.response.body_mutation.streamed_response.body == CONTENT[:10]
    flow.finish()


async def test_a_request_that_needs_no_usage_is_not_scanned_and_a_compressed_body_is_not_read(
        tmp_path: Path) -> None:
    gw = make_gateway(CONFIG, {"llama-8b": [A, B, C]}, seed=1)  # no budget, no usage records
    flow = PickerFlow(gw)
    await run(flow, start(), chunk(STREAMING), response_headers("text/event-stream"))
    assert flow._scanner is None
    out = await flow.handle(body(CONTENT + USAGE_EVENT[:25]))
    assert streamed(out, "response_body") == (CONTENT + USAGE_EVENT[:25], False)
    flow.finish()
    gw, path = gateway(tmp_path)
    flow = PickerFlow(gw)
    await run(flow, start(), chunk(STREAMING), response_headers("text/event-stream", ("content-encoding", "gzip")))
    out = await flow.handle(body(CONTENT + USAGE_EVENT + DONE, True))
    assert streamed(out, "response_body")[0] == CONTENT + USAGE_EVENT + DONE
    flow.finish()
    assert records(path)[0]["token_source"] == "estimated"
