"""Token budgets in the director and their settlement, without gRPC: reserve at admission, refund when
refused later, the include_usage rewrite, the settlement rule, and the pending-settlements table."""

from __future__ import annotations

import json
from typing import Any

import pytest

from modeldock.budgets.tokens import Usage
from modeldock.clock import FakeClock
from modeldock.config import hash_key
from modeldock.errors import RateLimited, Unavailable
from modeldock.gateway import Finished, Gateway, Routed
from modeldock.gateway.request import RequestHead
from modeldock.gateway.routed import ask_for_usage
from modeldock.gateway.settlement import PendingSettlements, UsageReport
from modeldock.usage.log import UsageLog
from modeldock.usage.metrics import UsageMetrics
from modeldock.usage.record import UsageRecord
from tests.support.extproc_messages import make_gateway

BUDGET = 1000
CONFIG: dict[str, Any] = {
    "tenants": [
        {"id": "tb", "api_key_hashes": [hash_key("k-tb")], "models": ["m*"], "tokens_per_minute": BUDGET},
        {"id": "free", "api_key_hashes": [hash_key("k-free")], "models": ["m*"]},
    ],
    "models": [{"name": "m", "endpoints": ["10.0.0.1:8000"]},
               {"name": "m-alias", "served_name": "m", "endpoints": ["10.0.0.1:8000"]}],
}
ENDPOINTS = {"m": ["10.0.0.1:8000"], "m-alias": ["10.0.0.1:8000"]}


def head(key: str) -> RequestHead:
    return RequestHead(method="POST", path="/v1/chat/completions", authorization=(f"Bearer {key}",),
                       content_length=None, request_id="client-1")


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


class Records:
    """A UsageLog sink that keeps what it is given."""

    def __init__(self) -> None:
        self.lines: list[UsageRecord] = []

    def write(self, data: bytes) -> None:
        self.lines.append(UsageRecord.from_json(data.decode()))

    def close(self) -> None:
        pass


def gateway(clock: FakeClock | None = None, records: Records | None = None) -> Gateway:
    gw = make_gateway(CONFIG, ENDPOINTS, clock=clock or FakeClock())
    if records is not None:
        gw.usage_log = UsageLog(records, UsageMetrics(None), gw.clock, "r1")
        gw.records_on = True
    return gw


async def test_a_budgeted_request_reserves_its_cost_and_carries_token_headers() -> None:
    gw = gateway()
    routed = await gw.route(head("k-tb"), body(max_tokens=100), "rid-1")
    assert routed.holdings.reservation is not None and routed.holdings.reservation.counted
    cost = routed.holdings.reservation.cost
    assert cost >= 100 and routed.holdings.reservation.tokens == cost
    assert routed.destination.route_metadata["x-ratelimit-limit-tokens"] == str(BUDGET)
    assert routed.destination.route_metadata["x-ratelimit-remaining-tokens"] == str(BUDGET - cost)
    # Not streaming: no rewrite.
    assert routed.usage.wants_usage and not routed.usage.drop_usage and routed.destination.body is None
    assert gw.budgets.held_count() == 1
    routed.release()


async def test_a_request_over_the_budget_gets_429_with_retry_after_and_holds_nothing() -> None:
    gw = gateway()
    # Leaves less than the next request's prompt estimate: even a capped output would not fit.
    first = await gw.route(head("k-tb"), body(max_tokens=BUDGET - 30), "rid-1")
    with pytest.raises(RateLimited) as err:
        await gw.route(head("k-tb"), body(max_tokens=900), "rid-2")
    assert err.value.code == "tokens_rate_limited" and err.value.headers["Retry-After"].isdigit()
    assert err.value.headers["x-ratelimit-limit-tokens"] == str(BUDGET)
    assert gw.budgets.held_count() == 1 and gw.admission.in_flight("tb") == 1
    first.release()
    assert gw.admission.in_flight("tb") == 0


async def test_an_output_limit_above_the_remaining_budget_goes_upstream_lowered_and_said_so() -> None:
    gw = gateway()
    first = await gw.route(head("k-tb"), body(max_tokens=800), "rid-1")
    assert first.holdings.reservation is not None
    left = BUDGET - first.holdings.reservation.tokens
    second = await gw.route(head("k-tb"), body(max_tokens=900), "rid-2")
    assert second.destination.body is not None and second.holdings.reservation is not None
    sent = json.loads(second.destination.body)["max_tokens"]
    assert sent == second.holdings.reservation.output == left - second.holdings.reservation.prompt and 0 < sent < 900
    assert second.destination.route_metadata["x-modeldock-output-limit"] == str(sent)
    assert second.destination.route_metadata["x-modeldock-output-limit-reason"] == "budget"
    assert second.destination.route_metadata["x-ratelimit-remaining-tokens"] == "0"
    # No limit from the client: the reserve default is written in, and said so.
    free = await gw.route(head("k-free"), body(), "rid-3")
    assert free.destination.body is None  # no budget and records off: the body goes as it came
    first.release()
    second.release()
    free.release()


async def test_a_request_refused_after_its_reservation_is_refunded_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    gw = gateway()

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise Unavailable("no endpoint", code="no_endpoint")

    monkeypatch.setattr(gw.flow, "pick_and_count", refuse)
    with pytest.raises(Unavailable):
        await gw.route(head("k-tb"), body(max_tokens=900), "rid-1")
    assert gw.budgets.held_count() == 0 and gw.admission.in_flight("tb") == 0
    monkeypatch.undo()
    # The whole budget is free again: the refunded 900+ tokens are not counted.
    routed = await gw.route(head("k-tb"), body(max_tokens=900), "rid-2")
    routed.release()


async def test_a_tenant_without_budgets_reserves_nothing_and_needs_no_usage() -> None:
    gw = gateway()
    routed = await gw.route(head("k-free"), body(max_tokens=5, stream=True), "rid-1")
    assert routed.holdings.reservation is None and not routed.usage.wants_usage and not routed.usage.drop_usage
    assert routed.destination.body is None and "x-ratelimit-limit-tokens" not in routed.destination.route_metadata
    routed.release()


async def test_usage_records_on_make_every_request_need_usage() -> None:
    gw = gateway(records=Records())
    routed = await gw.route(head("k-free"), body(max_tokens=5, stream=True), "rid-1")
    # No budget: nothing held.
    assert routed.holdings.reservation is not None and not routed.holdings.reservation.counted
    assert routed.usage.wants_usage and routed.usage.drop_usage
    routed.release()


async def test_a_streaming_request_asks_for_usage_and_envoy_drops_it_only_if_the_client_did_not() -> None:
    gw = gateway()
    routed = await gw.route(head("k-tb"), body(max_tokens=5, stream=True), "rid-1")
    assert routed.usage.drop_usage and routed.destination.body is not None
    assert json.loads(routed.destination.body)["stream_options"] == {"include_usage": True}
    routed.release()
    asked = await gw.route(head("k-tb"), body(max_tokens=5, stream=True, stream_options={"include_usage": True}),
                           "rid-2")
    assert asked.usage.wants_usage and not asked.usage.drop_usage and asked.destination.body is None
    asked.release()
    # An alias rewrite and the usage rewrite in one body.
    alias = await gw.route(head("k-tb"), json.dumps({"model": "m-alias", "messages": [], "stream": True,
                                                     "max_tokens": 3}).encode(), "rid-3")
    sent = alias.destination.body
    assert sent is not None and json.loads(sent)["model"] == "m" and alias.usage.drop_usage
    alias.release()


@pytest.mark.parametrize(("options", "added", "after"), [
    (None, True, {"include_usage": True}),
    ({"include_usage": False}, True, {"include_usage": True}),
    ({"continuous_usage_stats": False}, True, {"continuous_usage_stats": False, "include_usage": True}),
    ({"include_usage": True}, False, {"include_usage": True}),
    ("nonsense", False, "nonsense"),
])
def test_ask_for_usage(options: object, added: bool, after: object) -> None:
    data: dict[str, object] = {"stream": True}
    if options is not None:
        data["stream_options"] = options
    assert ask_for_usage(data) is added
    assert data["stream_options"] == after


def test_ask_for_usage_leaves_non_streaming_requests_alone() -> None:
    for data in ({}, {"stream": False}, {"stream": "true"}):
        before = dict(data)
        assert ask_for_usage(data) is False and data == before


async def _finished(gw: Gateway, rid: str, **fields: Any) -> Finished:
    routed: Routed = await gw.route(head("k-tb"), body(**fields), rid)
    routed.release()
    return Finished(routed, rid, "client-1", 0)


@pytest.mark.parametrize(("report", "charged", "source"), [
    (UsageReport("r", Usage(7, 11), True, 200, endpoint="10.0.0.1:8000", attempts=2), 18, "reported"),
    (UsageReport("r", None, False, 503), 0, "estimated"),
    (UsageReport("r", None, True, 200, cancelled=True), None, "estimated"),  # None: the reservation
    (None, None, "estimated"),
])
async def test_the_settlement_rule(report: UsageReport | None, charged: int | None, source: str) -> None:
    records = Records()
    gw = gateway(records=records)
    done = await _finished(gw, "r", max_tokens=50)
    reservation = done.routed.holdings.reservation
    assert reservation is not None
    gw.settle(done, report)
    gw.settle(done, UsageReport("r", Usage(1, 1), True, 200))  # a second settlement changes nothing
    expected = reservation.cost if charged is None else charged
    assert reservation.charged == expected and gw.budgets.held_count() == 0
    (record,) = records.lines[:1]
    assert record.token_source == source and record.request_id == "r" and record.client_request_id == "client-1"
    assert record.prompt_tokens + record.completion_tokens == expected
    if report is not None and report.attempts:
        assert record.retries == report.attempts - 1 and record.endpoint == report.endpoint


def table(clock: FakeClock, live: set[str]) -> tuple[PendingSettlements[str], list[tuple[str, UsageReport | None]]]:
    settled: list[tuple[str, UsageReport | None]] = []
    pending = PendingSettlements(clock, lambda item, report: settled.append((item, report)), live.__contains__,
                                 grace=2.0, sweep=False)
    return pending, settled


def test_report_after_the_stream_ended_settles_it() -> None:
    clock = FakeClock()
    pending, settled = table(clock, set())
    pending.ended("a", "item-a")
    assert settled == [] and len(pending) == 1
    report = UsageReport("a", Usage(1, 2), True, 200)
    pending.reported(report)
    pending.reported(report)  # a duplicate entry settles nothing more
    assert settled == [("item-a", report)] and len(pending) == 0


def test_report_before_the_stream_ended_is_kept_until_it_ends() -> None:
    clock = FakeClock()
    live = {"a"}
    pending, settled = table(clock, live)
    report = UsageReport("a", Usage(1, 2), True, 200)
    pending.reported(report)
    pending.reported(UsageReport("a", None, True, 200))  # the first report stands
    assert settled == [] and len(pending) == 1
    live.discard("a")
    pending.ended("a", "item-a")
    assert settled == [("item-a", report)] and len(pending) == 0


def test_no_report_within_the_grace_charges_the_reservation() -> None:
    clock = FakeClock()
    pending, settled = table(clock, set())
    pending.ended("a", "item-a")
    clock.advance(1.9)
    assert pending.expire() == 0
    clock.advance(0.2)
    assert pending.expire() == 1 and settled == [("item-a", None)] and pending.timed_out == 1
    pending.reported(UsageReport("a", Usage(1, 2), True, 200))  # too late: already settled
    assert len(settled) == 1 and len(pending) == 0


def test_reports_for_requests_this_replica_does_not_hold_are_ignored() -> None:
    pending, settled = table(FakeClock(), set())
    pending.reported(UsageReport("elsewhere", Usage(1, 2), True, 200))
    assert settled == [] and len(pending) == 0
    pending.ended("b", "item-b")
    pending.ended("b", "again")  # ended twice: the first stands
    assert pending.flush() == 1 and settled == [("item-b", None)] and len(pending) == 0


async def test_the_sweep_settles_on_its_own_and_stops() -> None:
    import asyncio

    from modeldock.clock import SystemClock

    settled: list[str] = []
    pending: PendingSettlements[str] = PendingSettlements(SystemClock(), lambda item, _r: settled.append(item),
                                                          lambda _rid: False, grace=0.08)
    pending.ended("a", "item-a")
    async with asyncio.timeout(2):
        while len(pending):
            await asyncio.sleep(0.01)
    assert settled == ["item-a"]
    await pending.stop()
