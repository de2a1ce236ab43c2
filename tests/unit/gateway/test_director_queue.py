"""The queue in the director: saturated requests wait, are dispatched when room appears, and
leave holding nothing. FakeClock, no gRPC."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from modeldock.config import hash_key
from modeldock.errors import BadRequest, RateLimited
from modeldock.gateway import Routed
from modeldock.gateway.request import RequestHead
from modeldock.picking import Sample, Saturated
from modeldock.types import Endpoint
from tests.support.gateway_rig import GatewayRig, settle

EP = Endpoint("10.0.0.1", 8000)
KEYS = {"acme": "k-acme", "bulk": "k-bulk", "vip": "k-vip"}


def _config(queue: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "tenants": [
            {"id": "acme", "api_key_hashes": [hash_key(KEYS["acme"])], "models": ["m"], "max_in_flight": 10,
             "priorities_allowed": ["batch"]},
            {"id": "bulk", "api_key_hashes": [hash_key(KEYS["bulk"])], "models": ["m"], "priority": "batch"},
            {"id": "vip", "api_key_hashes": [hash_key(KEYS["vip"])], "models": ["m"], "priority": "interactive",
             "weight": 3},
        ],
        "models": [{"name": "m", "endpoints": [EP.address]}],
        "queue": queue or {},
    }


class Rig(GatewayRig):
    def __init__(self, queue: dict[str, Any] | None = None, capacity: float = 1000.0) -> None:
        super().__init__(_config(queue), (EP,))
        self.observe(capacity=capacity)

    def observe(self, waiting: float = 0.0, kv: float = 0.0, capacity: float | None = None) -> None:
        self.picker.observe(EP, Sample(waiting, 0.0, kv, capacity=capacity), self.clock.monotonic())

    def route(self, max_tokens: int, tenant: str = "acme", priority: str = "") -> asyncio.Task[Routed]:
        body = {"model": "m", "prompt": "x" * 40, "max_tokens": max_tokens}
        return self.send(KEYS[tenant], body, f"req-{tenant}-{max_tokens}", priority)

    @property
    def queued(self) -> int:
        return len(self.gateway.flow.queues)

    def held(self) -> tuple[int, int, int]:
        """(admission tickets, leases, committed tokens) held now."""
        tickets = sum(self.admission.in_flight(t) for t in KEYS)
        return tickets, self.picker.total_in_flight(), self.picker.total_committed()


async def test_queued_then_dispatched_when_a_lease_of_the_model_is_released() -> None:
    rig = Rig()
    first = await rig.route(590)  # ~600 tokens of 1000
    second = rig.route(590)
    await settle()
    assert not second.done() and rig.queued == 1
    assert rig.held() == (2, 1, 600)  # admitted (its ticket held), not counted on an endpoint
    first.release()
    await settle()
    assert second.done() and rig.queued == 0
    routed = second.result()
    assert routed.destination.primary == EP and rig.held() == (1, 1, 600)
    routed.release()
    assert rig.held() == (0, 0, 0)


async def test_queued_then_dispatched_on_a_fresh_sample_showing_room() -> None:
    rig = Rig()
    rig.observe(waiting=3, kv=0.95)  # vLLM is queueing for memory
    task = rig.route(10)
    await settle()
    assert rig.queued == 1 and not task.done()
    rig.clock.advance(0.5)
    rig.observe(waiting=3, kv=0.95)  # still full: stays queued
    await settle()
    assert rig.queued == 1
    rig.observe(waiting=0, kv=0.5)
    await settle()
    routed = task.result()
    # prompt (40 chars) + max_tokens
    assert rig.held() == (1, 1, routed.holdings.lease.tokens) and routed.holdings.lease.tokens == 10 + 10
    routed.release()
    assert rig.held() == (0, 0, 0)


async def test_cancelled_while_queued_leaves_nothing_behind() -> None:
    rig = Rig()
    first = await rig.route(590)
    waiting = rig.route(590)
    await settle()
    assert rig.queued == 1
    waiting.cancel()  # the client went away: Envoy ends the ext_proc stream
    await settle()
    assert waiting.cancelled() and rig.queued == 0
    assert rig.held() == (1, 1, 600)
    first.release()
    await settle()
    assert rig.held() == (0, 0, 0)
    assert rig.gateway.flow.queues.get("m").counts.cancelled == 1


async def test_ttl_gives_429_queue_timeout_with_retry_after_and_releases_the_ticket() -> None:
    rig = Rig(queue={"ttl_seconds": 3, "retry_after_seconds": 2})
    first = await rig.route(590)
    waiting = rig.route(590)
    await settle()
    rig.clock.advance(3.0)
    rig.gateway.flow.queues.expire()
    await settle()
    with pytest.raises(RateLimited) as caught:
        waiting.result()
    assert caught.value.status == 429 and caught.value.code == "queue_timeout"
    assert caught.value.headers == {"Retry-After": "2"}
    assert "waited 3.000s" in caught.value.detail
    assert rig.held() == (1, 1, 600)
    first.release()
    assert rig.held() == (0, 0, 0)


async def test_the_drain_budget_sheds_once_the_oldest_has_waited_half_of_max_wait() -> None:
    rig = Rig(queue={"max_wait_seconds": 1.0, "backfill_seconds": 0})  # (the small ones would fit past the head)
    for total in (0.0, 100.0):  # busy at 100 tokens/s: 100 tokens drain within max_wait
        rig.picker.observe(EP, Sample(0.0, 1.0, 0.0, capacity=1000.0, tokens_total=total), rig.clock.monotonic())
        rig.clock.advance(1.0)
    assert rig.picker.speed("m") == pytest.approx(100)
    first = await rig.route(890)  # 900 of 1000 tokens
    second = rig.route(490)  # 500: waits
    await settle()
    rig.clock.advance(0.49)
    young = rig.route(190)  # 500 ahead of it, 5 s of work: but the queue may be a passing burst
    await settle()
    assert not young.done() and rig.queued == 2
    rig.clock.advance(0.01)  # the oldest has waited half of max_wait: it is not draining in time
    late = rig.route(90)
    await settle()
    with pytest.raises(RateLimited) as caught:
        late.result()
    assert caught.value.code == "queue_full" and rig.queued == 2
    first.release()  # the two queued go in turn; the shed one holds nothing
    await settle()
    (await second).release()
    await settle()
    (await young).release()
    assert rig.held() == (0, 0, 0)


async def test_a_full_queue_sheds_the_lower_class_first() -> None:
    rig = Rig(queue={"max_length": 2})
    first = await rig.route(590)
    batch = [rig.route(590 + i, tenant="bulk") for i in range(2)]
    await settle()
    assert rig.queued == 2
    vip = rig.route(450, tenant="vip")  # interactive: evicts the newest batch request (and does not fit yet)
    await settle()
    with pytest.raises(RateLimited) as caught:
        batch[1].result()
    assert caught.value.code == "queue_full" and "Retry-After" in caught.value.headers
    another = rig.route(400, tenant="bulk")  # batch, into a full queue of no lower class: refused
    await settle()
    with pytest.raises(RateLimited) as refused:
        another.result()
    assert refused.value.code == "queue_full"
    first.release()
    await settle()
    assert vip.done() and not batch[0].done()  # the higher class went first
    vip.result().release()
    await settle()
    batch[0].result().release()
    assert rig.held() == (0, 0, 0) and rig.queued == 0


async def test_dispatch_and_cancel_in_the_same_instant_count_once() -> None:
    rig = Rig()
    first = await rig.route(590)
    waiting = rig.route(590)
    await settle()
    first.release()  # dispatches the waiter synchronously: its pick is counted...
    assert rig.held() == (1, 1, 600)
    waiting.cancel()  # ...and its client leaves before the task resumes
    await settle()
    assert waiting.cancelled()
    assert rig.held() == (0, 0, 0)
    assert rig.gateway.flow.queues.get("m").counts.abandoned == 1


async def test_newcomers_queue_behind_waiters_instead_of_jumping_them() -> None:
    rig = Rig(queue={"backfill_seconds": 0})
    first = await rig.route(590)
    big = rig.route(590)
    await settle()
    small = rig.route(50)  # would fit now, but a request waits: it joins the queue
    await settle()
    assert rig.queued == 2 and not small.done()
    first.release()
    await settle()
    assert big.done() and small.done()  # in fair order, both fit now
    big.result().release()
    await settle()
    small.result().release()
    assert rig.held() == (0, 0, 0)


async def test_a_newcomer_that_fits_passes_a_waiter_that_does_not_until_backfill_seconds() -> None:
    rig = Rig(queue={"backfill_seconds": 0.5})
    first = await rig.route(590)
    big = rig.route(590)
    await settle()
    small = await rig.route(50)  # fits beside the first, where the big one does not: goes at once
    assert rig.queued == 1 and not big.done()
    rig.clock.advance(0.5)  # the big one has waited long enough: now it is not passed
    later = rig.route(50)
    await settle()
    assert rig.queued == 2 and not later.done()
    small.release()
    first.release()
    await settle()
    assert big.done() and later.done()
    big.result().release()
    later.result().release()
    assert rig.held() == (0, 0, 0)


async def test_priority_header_is_checked_against_the_tenant() -> None:
    rig = Rig()
    with pytest.raises(BadRequest) as caught:
        await rig.route(10, priority="interactive")
    assert caught.value.code == "priority_not_allowed" and "batch, standard" in caught.value.message
    assert rig.held() == (0, 0, 0)  # refused before admission
    routed = await rig.route(10, priority="batch")
    routed.release()
    tenant = rig.gateway.keys.authenticate(KEYS["acme"])
    head = RequestHead("POST", "/v1/chat/completions", (), None, "r", "batch")
    assert rig.gateway.request_class(tenant, head) == "batch"
    assert rig.gateway.request_class(tenant, head.__class__("POST", "/", (), None, "r")) == "standard"


async def test_with_the_queue_off_saturation_is_the_429_it_was() -> None:
    rig = Rig(queue={"enabled": False})
    first = await rig.route(590)
    with pytest.raises(Saturated) as caught:
        await rig.route(590)
    assert caught.value.status == 429 and caught.value.code == "endpoints_saturated"
    assert rig.held() == (1, 1, 600)
    first.release()
    assert rig.held() == (0, 0, 0)
