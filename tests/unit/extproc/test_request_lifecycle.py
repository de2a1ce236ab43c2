"""The registry of a request's life (gateway/lifecycle.py), as both adapters and the access log use it:
keys, retry reports, usage reports before and after the stream end, and the settlement mode per adapter."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from modeldock.clock import FakeClock
from modeldock.epp import PickerFlow, PickerServicer
from modeldock.extproc.flow import RequestFlow
from modeldock.extproc.server import ExtProcServicer
from modeldock.gateway import Finished, Gateway
from modeldock.gateway.lifecycle import Lifecycle, NoHooks, Outcome, Stage
from modeldock.gateway.settlement import UsageReport
from modeldock.types import Endpoint
from tests.support.extproc_messages import body_request, make_gateway
from tests.unit.epp.test_picker_flow import CONFIG, KEY, A, B, C, chunk, run, start

BUDGETED = {**CONFIG, "tenants": [{**CONFIG["tenants"][0], "tokens_per_minute": 100_000}]}
BODY = json.dumps({"model": "llama-8b", "messages": [{"role": "user", "content": "hi"}]}).encode()


class Recorder(NoHooks):
    def __init__(self) -> None:
        self.retried: list[str] = []
        self.finished: list[str] = []
        self.reported: list[str] = []

    def on_retried(self, request: Outcome) -> None:
        self.retried.append(request.rid)

    def on_finished(self, request: Outcome, seconds: float) -> None:
        self.finished.append(request.rid)

    def on_reported(self, report: UsageReport) -> None:
        self.reported.append(report.rid)


class Settles:
    """Stands in for Gateway.settle: what the registry settled, in order."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.calls: list[tuple[str, UsageReport | None]] = []

    def settle(self, done: Finished, report: UsageReport | None) -> None:
        self.calls.append((done.rid, report))


def registry(await_reports: bool = True) -> tuple[Gateway, Lifecycle, Settles, Recorder]:
    clock = FakeClock()
    gw = make_gateway(BUDGETED, {"llama-8b": [A, B, C]}, clock=clock, seed=1)
    settles, hooks = Settles(clock), Recorder()
    return gw, Lifecycle(settles, hooks, await_reports=await_reports, sweep=False), settles, hooks  # type: ignore[arg-type]


async def routed_flow(gw: Gateway, lifecycle: Lifecycle) -> RequestFlow:
    flow = RequestFlow(gw, lifecycle=lifecycle)
    resp = await asyncio.wait_for(flow.handle(body_request(BODY, authorization=f"Bearer {KEY}")), 5)
    assert resp.WhichOneof("response") == "request_body", resp
    return flow


def report(rid: str, prompt: int = 3) -> UsageReport:
    from modeldock.budgets.tokens import Usage

    return UsageReport(rid=rid, usage=Usage(prompt, 2), reached_backend=True, status=200)


async def test_keys_are_minted_per_registry_and_never_the_clients_id() -> None:
    gw, first, _, _ = registry()
    _, second, _, _ = registry()
    flows = [RequestFlow(gw, lifecycle=first) for _ in range(3)] + [RequestFlow(gw, lifecycle=second)]
    rids = [f.rid for f in flows]
    assert len(set(rids)) == 4 and "r-1" not in rids
    # One prefix per registry (per process), a counter after it.
    assert len({r.rsplit("-", 1)[0] for r in rids[:3]}) == 1 and rids[3].rsplit("-", 1)[0] != rids[0].rsplit("-", 1)[0]


async def test_a_retry_report_moves_an_open_request_once_and_an_ended_one_not_at_all() -> None:
    gw, lifecycle, _, hooks = registry()
    flow = await routed_flow(gw, lifecycle)
    other = next(a for a in (A, B, C) if a != flow.primary)
    lifecycle.retried("r-1", other)  # the client's id names no request
    assert hooks.retried == [] and flow.stage is Stage.OPEN and not flow.retried
    stages = [flow.stage]
    lifecycle.retried(flow.rid, other)
    lifecycle.retried(flow.rid, other)  # counted there already: no second move
    stages.append(flow.stage)
    assert hooks.retried == [flow.rid] and stages == [Stage.OPEN, Stage.RETRIED] and flow.retried
    assert gw.picker.in_flight(Endpoint.parse(other)) == 1
    flow.finish()
    back = flow.primary
    lifecycle.retried(flow.rid, back)  # after its end: its key is gone
    assert hooks.retried == [flow.rid] and gw.picker.total_in_flight() == 0
    assert hooks.finished == [flow.rid] and flow.stage is Stage.ENDED


async def test_a_report_before_the_stream_end_is_held_and_settles_at_the_end() -> None:
    gw, lifecycle, settles, hooks = registry()
    flow = await routed_flow(gw, lifecycle)
    early = report(flow.rid)
    lifecycle.reported(early)
    assert flow.stage is Stage.REPORTED and settles.calls == [] and lifecycle.pending() == 1
    flow.finish()
    assert settles.calls == [(flow.rid, early)] and lifecycle.pending() == 0
    assert hooks.reported == [flow.rid] and hooks.finished == [flow.rid]
    flow.finish()  # a second end changes nothing
    assert len(settles.calls) == 1 and hooks.finished == [flow.rid]


async def test_a_report_after_the_end_settles_and_none_within_grace_settles_without_one() -> None:
    gw, lifecycle, settles, _ = registry()
    late, silent = await routed_flow(gw, lifecycle), await routed_flow(gw, lifecycle)
    late.finish()
    silent.finish()
    assert settles.calls == [] and lifecycle.pending() == 2
    lifecycle.reported(report(late.rid))
    assert [rid for rid, _ in settles.calls] == [late.rid]
    settles.clock.advance(lifecycle.settlements.grace)
    lifecycle.settlements.expire()
    assert settles.calls[1] == (silent.rid, None) and lifecycle.pending() == 0
    lifecycle.reported(report(silent.rid))  # after its settlement: not ours any more
    assert len(settles.calls) == 2


async def test_the_registry_holds_nothing_after_a_rejected_a_retried_a_cut_or_an_unrouted_request() -> None:
    gw, lifecycle, settles, _ = registry()
    # Rejected (a key nobody has): answered, never routed, nothing held.
    refused = RequestFlow(gw, lifecycle=lifecycle)
    resp = await asyncio.wait_for(refused.handle(body_request(BODY, authorization="Bearer nobody")), 5)
    assert resp.WhichOneof("response") == "immediate_response"
    refused.finish()
    # Retried onto another endpoint, then reported.
    retried = await routed_flow(gw, lifecycle)
    lifecycle.retried(retried.rid, next(a for a in (A, B, C) if a != retried.primary))
    # Cut mid-stream: its stream ends and no report ever comes.
    cut = await routed_flow(gw, lifecycle)
    # A stream that ended before its body came (the client left at once).
    RequestFlow(gw, lifecycle=lifecycle).finish()
    assert lifecycle.opened() == 2 and gw.picker.total_in_flight() == 2
    retried.finish()
    lifecycle.reported(report(retried.rid))
    cut.finish()
    assert lifecycle.opened() == 0 and lifecycle.pending() == 1 and gw.picker.total_in_flight() == 0
    settles.clock.advance(lifecycle.settlements.grace)
    lifecycle.settlements.expire()
    assert lifecycle.pending() == 0 and [rid for rid, _ in settles.calls] == [retried.rid, cut.rid]
    assert settles.calls[1] == (cut.rid, None)  # no report: settled without one (its reservation charged)


async def test_picker_mode_settles_at_the_stream_end_and_ignores_the_access_log() -> None:
    gw, lifecycle, settles, hooks = registry(await_reports=False)
    flow = PickerFlow(gw, lifecycle=lifecycle)
    await run(flow, start(), chunk(BODY))
    assert flow.routed is not None
    lifecycle.reported(report(flow.rid))  # a gateway modeldock did not configure sends none: not acted on
    lifecycle.retried(flow.rid, B)
    assert settles.calls == [] and hooks.reported == [] and hooks.retried == []
    flow.finish()
    assert settles.calls == [(flow.rid, None)] and hooks.finished == [flow.rid] and lifecycle.pending() == 0


async def test_servicers_use_the_registry_they_are_given_while_it_holds_nothing() -> None:
    """An empty registry is still the one to use (it has a size: `or` would have dropped it)."""
    gw, lifecycle, _, _ = registry()
    assert ExtProcServicer(gw, lifecycle).lifecycle is lifecycle
    assert PickerServicer(gw, lifecycle=lifecycle).lifecycle is lifecycle
    flow = PickerFlow(gw, lifecycle=lifecycle)
    assert flow.rid.rsplit("-", 1)[0] == lifecycle.key().rsplit("-", 1)[0]


def test_picker_mode_loads_no_extproc_module() -> None:
    """epp and extproc are siblings: the shared replies live below both (modeldock/replies.py)."""
    code = "import sys, modeldock.epp; print(sorted(m for m in sys.modules if m.startswith('modeldock.extproc')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
