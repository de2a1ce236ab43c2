"""FlowQueue: priority bands, token-weighted fairness, FIFO, bounds, TTL, cancel/dispatch contract."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from flow_helpers import Harness
from prometheus_client import CollectorRegistry

from modeldock.clock import SystemClock
from modeldock.errors import RateLimited, Unavailable
from modeldock.flowcontrol import (
    FlowQueue,
    FlowQueues,
    Item,
    QueueConfig,
    QueueMetrics,
    State,
)
from tests.unit.flowcontrol.flow_helpers import waiting


def tokens_and_requests(order: list[tuple[str, int, str]]) -> tuple[Counter[str], Counter[str]]:
    tokens: Counter[str] = Counter()
    requests: Counter[str] = Counter()
    for tenant, cost, _ in order:
        tokens[tenant] += cost
        requests[tenant] += 1
    return tokens, requests


def test_equal_weights_share_tokens_not_requests(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop, max_length=1000)
    for _ in range(100):
        h.queue.enqueue(waiting("long", 400))
    for _ in range(400):
        h.queue.enqueue(waiting("short", 100))
    tokens, requests = tokens_and_requests(h.claim_all(budget=20_000))
    assert abs(tokens["long"] - tokens["short"]) <= 400  # within one of the largest item
    assert requests["short"] >= 3.5 * requests["long"]


def test_weights_two_to_one(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop, max_length=1000)
    for _ in range(300):
        h.queue.enqueue(waiting("gold", 100, weight=2.0))
        h.queue.enqueue(waiting("bronze", 100, weight=1.0))
    tokens, _ = tokens_and_requests(h.claim_all(budget=30_000))
    assert tokens["gold"] + tokens["bronze"] == 30_000
    assert tokens["gold"] == pytest.approx(2 * tokens["bronze"], abs=200)


def test_fifo_within_a_tenant(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop)
    items = [h.queue.enqueue(waiting("a", cost)) for cost in (5, 50, 500, 1)]
    h.claim_all()
    assert [item.state for item in items] == [State.DISPATCHED] * 4
    assert [item.future.result() for item in items] == [1, 2, 3, 4]


def test_idle_tenant_gets_no_credit_and_busy_tenant_no_penalty_for_cancelled(
    idle_loop: asyncio.AbstractEventLoop,
) -> None:
    h = Harness(idle_loop)
    first = h.queue.enqueue(waiting("a", 1000))
    h.queue.enqueue(waiting("a", 10))
    h.queue.cancel(first)  # left without being served: charges nothing to the item behind it
    h.queue.enqueue(waiting("b", 10))
    assert [t for t, _, _ in h.claim_all()] == ["a", "b"]  # equal start tags: older first


def test_higher_class_always_first(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop)
    h.queue.enqueue(waiting("a", 10, klass="batch"))
    h.queue.enqueue(waiting("b", 10, klass="standard"))
    h.queue.enqueue(waiting("c", 10_000, klass="interactive"))
    assert [k for _, _, k in h.claim_all()] == ["interactive", "standard", "batch"]


def test_no_room_for_the_head_stops_dispatch(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop)
    h.queue.enqueue(waiting("a", 500, klass="interactive"))
    h.queue.enqueue(waiting("b", 10, klass="batch"))
    assert h.claim_all(budget=100) == []  # the small batch item does not jump the big interactive one
    assert len(h.queue) == 2


def test_full_queue_sheds_the_newest_lowest_class(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop, max_length=3, retry_after_seconds=4)
    batch = [h.queue.enqueue(waiting(t, 10, klass="batch")) for t in ("a", "b", "c")]
    with pytest.raises(RateLimited) as refused:
        h.queue.enqueue(waiting("d", 10, klass="batch"))  # the lowest class present: refused itself
    assert refused.value.code == "queue_full"
    assert refused.value.headers == {"Retry-After": "4"}
    assert refused.value.status == 429
    h.queue.enqueue(waiting("e", 10, klass="interactive"))
    assert batch[2].state is State.REJECTED and batch[2].reason == "queue_full"
    evicted = batch[2].future.exception()
    assert isinstance(evicted, RateLimited) and evicted.body()["error"]["code"] == "queue_full"
    h.queue.enqueue(waiting("f", 10, klass="standard"))
    assert batch[1].state is State.REJECTED
    assert batch[0].state is State.QUEUED
    assert len(h.queue) == 3
    h.queue.enqueue(waiting("g", 10, klass="standard"))  # evicts the last batch item
    with pytest.raises(RateLimited):
        h.queue.enqueue(waiting("h", 10, klass="standard"))  # now standard is the lowest present
    assert h.queue.counts.offered == 8 and h.queue.counts.rejected == 5


def test_full_queue_sheds_the_tenant_holding_the_most_of_the_class(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop, max_length=4)
    flood = [h.queue.enqueue(waiting("a", 100)) for _ in range(3)]
    quiet = h.queue.enqueue(waiting("b", 100))
    newcomer = h.queue.enqueue(waiting("b", 100))  # full: a holds 300 tokens, b would hold 200 -> a's newest goes
    assert flood[2].state is State.REJECTED and flood[2].reason == "queue_full"
    assert quiet.state is newcomer.state is State.QUEUED
    with pytest.raises(RateLimited, match="is full"):
        h.queue.enqueue(waiting("b", 100))  # now b would hold 300 against a's 200: b is refused itself
    with pytest.raises(RateLimited, match="is full"):
        h.queue.enqueue(waiting("a", 10))  # the heaviest tenant never evicts itself
    # By tokens per weight: a tenant of weight 4 holding 400 holds less than one of weight 1 holding 200.
    h2 = Harness(idle_loop, max_length=3)
    heavy = [h2.queue.enqueue(waiting("w", 200, weight=4.0)) for _ in range(2)]
    light = h2.queue.enqueue(waiting("l", 200))
    h2.queue.enqueue(waiting("w", 10, weight=4.0))  # l holds 200 against w's (400 + 10) / 4: l's newest goes
    assert light.state is State.REJECTED and all(item.state is State.QUEUED for item in heavy)
    assert h.queue.counts.rejected == 3 and len(h.queue) == 4


def test_per_tenant_bound(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop, max_per_tenant=2)
    h.queue.enqueue(waiting("a", 1))
    h.queue.enqueue(waiting("a", 1, klass="interactive"))
    with pytest.raises(RateLimited, match="already has 2"):
        h.queue.enqueue(waiting("a", 1, klass="interactive"))
    h.queue.enqueue(waiting("b", 1))
    assert h.queue.tenant_length("a") == 2 and len(h.queue) == 3


def test_ttl_expires_on_the_fake_clock(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop, ttl_seconds=5.0)
    old = h.queue.enqueue(waiting("a", 1))
    h.clock.advance(3.0)
    young = h.queue.enqueue(waiting("a", 1))
    assert h.queue.next_deadline() == old.deadline
    h.clock.advance(1.9)
    assert h.queue.expire() == 0
    h.clock.advance(0.2)
    assert h.claim_all(budget=0) == []  # dispatch expires first
    assert old.state is State.REJECTED and old.reason == "queue_timeout"
    assert young.state is State.QUEUED and len(h.queue) == 1
    h.clock.advance(3.0)
    assert h.queue.expire() == 1
    error = young.future.exception()
    assert isinstance(error, RateLimited) and error.code == "queue_timeout" and "Retry-After" in error.headers


async def test_wait_times_out_on_time_with_nothing_else_happening() -> None:
    queue: FlowQueue[int] = FlowQueue("m", QueueConfig(ttl_seconds=0.05), SystemClock(), release=lambda c: None)
    item = queue.enqueue(waiting("a", 1))
    began = time.monotonic()
    with pytest.raises(RateLimited) as timed_out:
        await queue.wait(item)
    waited = time.monotonic() - began
    assert timed_out.value.code == "queue_timeout"
    assert 0.045 <= waited < 0.05 + 0.1
    assert len(queue) == 0


async def test_wait_returns_the_claim() -> None:
    h = Harness(None)
    item = h.queue.enqueue(waiting("a", 1))
    waiter = asyncio.create_task(h.queue.wait(item))
    await asyncio.sleep(0)
    h.claim_all()
    assert await waiter == 1
    assert h.queue.cancel(item) is False  # the caller owns the claim now
    assert h.released == []


async def test_cancelled_waiter_leaves_at_once() -> None:
    h = Harness(None)
    item = h.queue.enqueue(waiting("a", 1))
    waiter = asyncio.create_task(h.queue.wait(item))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert item.state is State.CANCELLED and len(h.queue) == 0 and h.queue.tenant_length("a") == 0
    assert h.claim_all() == [] and h.released == []
    assert h.queue.counts.cancelled == 1


@pytest.mark.parametrize("cancel_first", [False, True])
async def test_dispatch_and_cancel_in_the_same_instant_hand_the_claim_back(cancel_first: bool) -> None:
    h = Harness(None)
    item = h.queue.enqueue(waiting("a", 1))
    waiter = asyncio.create_task(h.queue.wait(item))
    await asyncio.sleep(0)
    if cancel_first:  # the task is told to stop, but has not run yet: the item is still queued
        waiter.cancel()
        h.claim_all()
    else:
        h.claim_all()
        waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert item.state is State.DISPATCHED
    assert h.released == [1]  # exactly once
    assert h.queue.cancel(item) is False and h.released == [1]
    assert h.queue.counts.abandoned == 1 and h.queue.counts.dispatched == 1


async def test_a_rejection_from_claim_goes_to_that_item_only() -> None:
    h = Harness(None)
    doomed = h.queue.enqueue(waiting("a", 1))
    fine = h.queue.enqueue(waiting("b", 1))

    def claim(item: Item[int]) -> int | None:
        if item is doomed:
            raise Unavailable("no ready endpoint", code="no_endpoints")
        return 7

    assert h.queue.dispatch(claim) == 1
    with pytest.raises(Unavailable):
        await h.queue.wait(doomed)
    assert await h.queue.wait(fine) == 7


def test_reject_all_and_per_model_queues(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop)
    queues: FlowQueues[int] = FlowQueues(QueueConfig(), h.clock, release=h.released.append)
    assert queues.get("x") is queues.get("x") and queues.get("x") is not queues.get("y")
    assert len(queues) == 0 and queues.discard("nope", Unavailable("gone")) == 0


def test_metrics_by_tenant_class_and_reason(idle_loop: asyncio.AbstractEventLoop) -> None:
    registry = CollectorRegistry()
    h = Harness(idle_loop, max_length=1)
    h.queue = FlowQueue("m", h.config, h.clock, release=h.released.append,
                        metrics=QueueMetrics(registry), loop=idle_loop)
    h.queue.enqueue(waiting("a", 1, klass="batch"))
    labels = {"model": "m", "tenant": "a", "class": "batch"}
    assert registry.get_sample_value("modeldock_queue_length", labels) == 1
    h.queue.enqueue(waiting("b", 1, klass="interactive"))
    assert registry.get_sample_value("modeldock_queue_length", labels) == 0
    assert registry.get_sample_value("modeldock_queue_rejected_total", {**labels, "reason": "queue_full"}) == 1
    h.clock.advance(0.5)
    h.claim_all()
    interactive = {"model": "m", "tenant": "b", "class": "interactive"}
    assert registry.get_sample_value("modeldock_queue_dispatched_total", interactive) == 1
    assert registry.get_sample_value("modeldock_queue_wait_seconds_sum", interactive) == pytest.approx(0.5)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="default_class"):
        QueueConfig(default_class="gold")
    with pytest.raises(ValueError):
        QueueConfig(max_length=0)
    with pytest.raises(ValueError, match="unknown queue class"):
        QueueConfig().priority("gold")
    config = QueueConfig()
    assert config.enabled and config.classes == {"interactive": 2, "standard": 1, "batch": 0}


def test_fair_order_estimates_the_tokens_ahead(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop, max_length=1000)
    for _ in range(5):
        h.queue.enqueue(waiting("a", 100))
    prio = h.config.priority("standard")
    assert h.queue.ahead("a", prio) == 500  # behind all of its own
    assert h.queue.ahead("b", prio) == 0  # a new tenant starts at V: next in fair order
    h.queue.enqueue(waiting("b", 100))
    assert h.queue.ahead("b", prio) == pytest.approx(200)  # its own, then a's one ahead of its next
    assert h.queue.ahead("b", prio, weight=2.0) == pytest.approx(150)  # a heavier tenant gets there sooner
    assert h.queue.ahead("x", h.config.priority("interactive")) == 0  # a higher class jumps them all
    assert h.queue.ahead("x", h.config.priority("batch")) == 600  # a lower class waits for everyone


def test_enqueue_sheds_what_would_not_drain_in_time(idle_loop: asyncio.AbstractEventLoop) -> None:
    # 500 tokens/s for 0.5 s: 250 tokens may be ahead of a new item.
    h = Harness(idle_loop, max_length=1000, max_wait_seconds=0.5, drain_rate=lambda: 500.0)
    for _ in range(3):
        h.queue.enqueue(waiting("a", 100))
    with pytest.raises(RateLimited) as caught:
        h.queue.enqueue(waiting("a", 100))  # 300 tokens ahead of it
    assert caught.value.code == "queue_full" and "0.5s" in caught.value.message
    assert caught.value.headers == {"Retry-After": "1"}
    h.queue.enqueue(waiting("b", 100))  # the other tenant is next in fair order: it waits
    h.queue.enqueue(waiting("i", 100, klass="interactive"))
    assert len(h.queue) == 5 and h.queue.counts.rejected == 1
    assert h.queue.counts.offered == h.queue.counts.rejected + len(h.queue)


def test_the_drain_budget_sheds_only_once_the_oldest_has_waited(idle_loop: asyncio.AbstractEventLoop) -> None:
    # A burst below capacity queues for a moment and drains: nothing is shed for it. A queue whose
    # oldest item has waited `shed_after` (here all of max_wait) is not draining in time: the budget applies.
    h = Harness(idle_loop, max_length=1000, max_wait_seconds=0.5, drain_rate=lambda: 500.0, shed_after=1.0)
    for _ in range(3):
        h.queue.enqueue(waiting("a", 100))
    h.clock.advance(0.2)
    assert h.queue.oldest_wait() == pytest.approx(0.2)
    h.queue.enqueue(waiting("a", 100))  # 300 ahead, but the queue is young
    h.clock.advance(0.3)
    with pytest.raises(RateLimited, match="would not drain"):
        h.queue.enqueue(waiting("a", 100))
    h.claim_all(budget=10_000)
    assert h.queue.oldest_wait() == 0.0 and len(h.queue) == 0


def test_a_protected_request_counts_only_its_own_flow_ahead(idle_loop: asyncio.AbstractEventLoop) -> None:
    # Dispatch tries a protected item past the unprotected heads, so what it waits for is its own
    # flow (and higher classes): the drain budget must not shed it for the flood in its band.
    rate = [1e9]  # the flood queues while the endpoints drain fast; then 500 tokens/s: 250 may be ahead
    h = Harness(idle_loop, max_length=1000, max_wait_seconds=0.5, drain_rate=lambda: rate[0])
    prio = h.config.priority("standard")
    for _ in range(5):
        h.queue.enqueue(waiting("a", 100))
    rate[0] = 500.0
    for _ in range(2):
        h.queue.enqueue(waiting("b", 100), protected=True)
    assert h.queue.ahead("b", prio, protected=True) == 200
    assert h.queue.ahead("b", prio) == pytest.approx(400)  # in fair order a's would interleave
    with pytest.raises(RateLimited):
        h.queue.enqueue(waiting("b", 100))  # not protected: a's items count
    h.queue.enqueue(waiting("i", 50, klass="interactive"))
    assert h.queue.ahead("b", prio, protected=True) == 250  # a higher class is ahead all the same
    rate[0] = 480.0  # 240 may be ahead
    with pytest.raises(RateLimited):
        h.queue.enqueue(waiting("b", 100), protected=True)


# -- backfill ---------------------------------------------------------------------------------


def test_a_smaller_request_passes_a_head_that_does_not_fit(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop, backfill_seconds=0.5)
    registry = CollectorRegistry()
    h.queue = FlowQueue("m", h.config, h.clock, release=h.released.append,
                        metrics=QueueMetrics(registry), loop=idle_loop)
    big = h.queue.enqueue(waiting("a", 500))
    small = h.queue.enqueue(waiting("a", 50))
    other = h.queue.enqueue(waiting("b", 60))
    assert h.claim_all(budget=120) == [("a", 50, "standard"), ("b", 60, "standard")]
    assert big.state is State.QUEUED and small.state is other.state is State.DISPATCHED
    # a's small one passed a's head; then b's head came first in fair order (a had had 50 tokens).
    assert h.queue.counts.backfilled == 1
    labels = {"model": "m", "tenant": "a", "class": "standard"}
    assert registry.get_sample_value("modeldock_queue_backfilled_total", labels) == 1
    assert registry.get_sample_value("modeldock_queue_dispatched_total", labels) == 1
    assert h.claim_all(budget=500) == [("a", 500, "standard")]


def test_past_backfill_seconds_the_head_blocks_again(idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop, backfill_seconds=0.5)
    h.queue.enqueue(waiting("a", 500))
    h.queue.enqueue(waiting("a", 50))
    h.clock.advance(0.5)  # the head has waited its share of passing: room now goes to it
    assert h.claim_all(budget=120) == []
    strict = Harness(idle_loop, backfill_seconds=0)
    strict.queue.enqueue(waiting("a", 500))
    strict.queue.enqueue(waiting("a", 50))
    assert strict.claim_all(budget=120) == []


def test_by_default_a_head_is_passed_for_twice_max_wait(idle_loop: asyncio.AbstractEventLoop) -> None:
    # The drain budget admits a request expecting it to start within about max_wait_seconds; a head
    # that has waited that long still lets smaller requests use room it cannot, until twice that.
    h = Harness(idle_loop)
    assert h.config.backfill_seconds == 2 * (h.config.max_wait_seconds or 0)
    h.queue.enqueue(waiting("a", 500))
    h.queue.enqueue(waiting("a", 50))
    h.queue.enqueue(waiting("a", 60))
    h.clock.advance(h.config.max_wait_seconds or 0)
    assert h.claim_all(budget=100) == [("a", 50, "standard")]
    h.clock.advance(h.config.backfill_seconds)
    assert h.claim_all(budget=120) == []  # the 60 would fit: the head blocks


def test_backfill_stays_in_the_heads_class_and_tries_only_smaller_items(
        idle_loop: asyncio.AbstractEventLoop) -> None:
    h = Harness(idle_loop, backfill_seconds=0.5)
    h.queue.enqueue(waiting("a", 100, klass="interactive"))
    h.queue.enqueue(waiting("b", 10, klass="batch"))  # a lower class never passes a higher one
    h.queue.enqueue(waiting("c", 100, klass="interactive"))  # as large as the head: not tried
    tried: list[int] = []

    def claim(item: Item[int]) -> int | None:
        tried.append(item.cost)
        return None

    assert h.queue.dispatch(claim) == 0
    assert tried == [100]  # the head only


def test_backfill_tries_a_bounded_number_of_items(idle_loop: asyncio.AbstractEventLoop) -> None:
    from modeldock.flowcontrol.queue import BACKFILL_TRIES

    h = Harness(idle_loop, backfill_seconds=0.5, max_length=100)
    h.queue.enqueue(waiting("a", 1000))
    for cost in range(90, 10, -1):  # each smaller than the last, none fits
        h.queue.enqueue(waiting("a", cost))
    tried: list[int] = []

    def claim(item: Item[int]) -> int | None:
        tried.append(item.cost)
        return None

    h.queue.dispatch(claim)
    assert tried == [1000, *range(90, 90 - BACKFILL_TRIES, -1)]


def test_a_backfilled_request_counts_against_its_tenants_share(idle_loop: asyncio.AbstractEventLoop) -> None:
    # a's small request passed a's big head: a has had 100 tokens, so b's equal-cost head goes
    # before a's next one once room for both appears.
    h = Harness(idle_loop, backfill_seconds=0.5)
    h.queue.enqueue(waiting("a", 300))
    h.queue.enqueue(waiting("a", 100))
    assert h.claim_all(budget=100) == [("a", 100, "standard")]
    h.queue.enqueue(waiting("b", 300))
    assert [t for t, _, _ in h.claim_all(budget=300)] == ["b"]
