"""The shared state on a real Redis Cluster (3 masters, 1 replica each): the request windows, the token
budgets with leases and the sharing store with tenants on different masters; the batcher split by
node; MOVED and ASK after a manual slot migration; a killed master's calls failing, then served by its
promoted replica without a restart. The topology is shared by the module (it takes seconds to start);
the test that kills a master runs last and restores it."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator

import pytest
import redis
from redis.crc import key_slot

from modeldock.admission.limits import Admission
from modeldock.admission.redis_window import RedisWindow, tenant_key
from modeldock.budgets.budgets import TokenBudgets
from modeldock.budgets.redis_batch import RedisBatch, Script
from modeldock.budgets.redis_window import budget_key
from modeldock.budgets.tokens import Usage
from modeldock.clock import SystemClock
from modeldock.devstack.redis_cluster import RedisClusterTopology
from modeldock.errors import RateLimited
from modeldock.redis_client import RedisUnavailable, make_redis_client
from modeldock.sharing.store import RedisShareStore
from tests.support.redis_server import RedisServer
from tests.unit.admission.admission_helpers import config, tenant
from tests.unit.budgets.budget_helpers import budget_config, budget_tenant

pytestmark = pytest.mark.timeout(120)

# Returns its key and the key's new count: shows where each item ran and that it ran once.
INCR = Script("return {KEYS[1], redis.call('INCR', KEYS[1])}")


@pytest.fixture(scope="module")
def topology() -> Iterator[RedisClusterTopology]:
    with RedisClusterTopology() as cluster:
        yield cluster


@pytest.fixture
def cluster(topology: RedisClusterTopology) -> RedisClusterTopology:
    topology.flush()
    return topology


def spread_tenants(topology: RedisClusterTopology) -> list[str]:
    """One tenant id per master, each tenant's `{id}` slot on a different master."""
    found: dict[int, str] = {}
    for n in itertools.count():
        name = f"t{n}"
        found.setdefault(topology.master_of(f"x:{{{name}}}").port, name)
        if len(found) == topology.master_count:
            return sorted(found.values())
    raise AssertionError("unreachable")


def node_get(server: RedisServer, key: str) -> bytes | None:
    """GET on that one node (not through the cluster client): the key must live there."""
    with redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2) as client:
        value = client.get(key)
    return value if isinstance(value, bytes) else None


def batch_client(topology: RedisClusterTopology, timeout_s: float = 1.0) -> RedisBatch:
    return RedisBatch(lambda: make_redis_client(topology.url, timeout_s, batch=True, cluster=True),
                      timeout_s=timeout_s)


async def test_request_windows_admit_exactly_the_limit_per_tenant_on_each_master(
        cluster: RedisClusterTopology) -> None:
    names = spread_tenants(cluster)
    tenants = [tenant(name, rpm=5) for name in names]
    cfg = config(*tenants, redis_url=cluster.url, redis_cluster=True, redis_timeout_ms=1000)
    replicas = [Admission(cfg, SystemClock()), Admission(cfg, SystemClock())]

    async def admitted(admission: Admission, who: int) -> bool:
        try:
            (await admission.admit(tenants[who], "m")).release()
            return True
        except RateLimited:
            return False

    try:
        results = await asyncio.gather(*(admitted(replica, who) for who in range(len(tenants))
                                         for replica in replicas for _ in range(6)))
        per_tenant = [sum(results[who * 12:(who + 1) * 12]) for who in range(len(tenants))]
        assert per_tenant == [5, 5, 5]  # each replica's local window allows 5: Redis made it 5 overall
        masters = {cluster.master_of(tenant_key(name)).port for name in names}
        assert len(masters) == 3
    finally:
        for replica in replicas:
            await replica.close()


async def test_token_budgets_with_leases_hold_each_tenants_budget_on_its_master(
        cluster: RedisClusterTopology) -> None:
    names = spread_tenants(cluster)
    tenants = [budget_tenant(name, tpm=16_000) for name in names]
    cfg = budget_config(*tenants, redis_url=cluster.url, redis_cluster=True, redis_timeout_ms=1000)
    replicas = [TokenBudgets(cfg, SystemClock()), TokenBudgets(cfg, SystemClock())]
    ids = itertools.count()

    async def one(budgets: TokenBudgets, who: int) -> int:
        try:
            reservation = await budgets.reserve(tenants[who], "m", 100, f"r{next(ids)}")
        except RateLimited:
            return 0
        reservation.finish_nowait(sent=True, usage=Usage(prompt_tokens=60, completion_tokens=40))
        return 100

    try:
        for _ in range(10):  # rounds, so leases are granted, drawn from and topped up
            got = await asyncio.gather(*(one(budgets, who) for who in range(len(tenants))
                                         for budgets in replicas for _ in range(10)))
        for budgets in replicas:
            await budgets.flush()
        draws = sum(budgets._leases.draws for budgets in replicas)
        assert draws > 0  # admitted from leases, not only per request
        assert not any(got[-len(tenants) * 20:])  # 20,000 tokens asked for each: the budget ran out
        for name in names:
            key = budget_key(name, "minute")
            with redis.Redis(host="127.0.0.1", port=cluster.master_of(key).port, socket_timeout=2) as node:
                entries = node.hgetall(key + ":amt")
            total = sum(int(v) for k, v in entries.items() if k != b"~total")
            assert 16_000 - 2 * 1_000 <= total <= 16_000  # at most the budget; at most a lease each unused
    finally:
        for budgets in replicas:
            await budgets.close()


async def test_the_batcher_splits_a_batch_by_node_and_answers_in_order(cluster: RedisClusterTopology) -> None:
    names = spread_tenants(cluster)
    keys = [f"k:{{{names[i % 3]}}}:{i}" for i in range(9)]
    batch = batch_client(cluster)
    try:
        first = asyncio.ensure_future(batch.call(INCR, ["k:{warm}"], []))
        await asyncio.sleep(0)  # the first call is in flight: the next nine queue for one write
        replies = await asyncio.gather(*(batch.call(INCR, [key], []) for key in keys))
        await first
        assert replies == [[key.encode(), 1] for key in keys]
        assert batch.round_trips == 2
        for key in keys:
            assert node_get(cluster.master_of(key), key) == b"1"  # ran on the master of its slot
        assert {cluster.master_of(key).port for key in keys} == {node.port for node in cluster.masters()}
    finally:
        await batch.close()


async def test_moved_and_ask_after_a_slot_migration_are_followed(cluster: RedisClusterTopology) -> None:
    name = spread_tenants(cluster)[0]
    key = f"k:{{{name}}}"
    slot = key_slot(key.encode())
    batch = batch_client(cluster)
    window = RedisWindow(lambda: make_redis_client(cluster.url, 1.0, cluster=True), timeout_s=1.0)
    try:
        assert await batch.call(INCR, [key], []) == [key.encode(), 1]
        assert (await window.try_acquire(tenant_key(name), 10)).allowed
        source = cluster.master_of(key)
        target, other = [node for node in cluster.masters() if node is not source][:2]
        cluster.migrate_slot(slot, target)  # both clients' slot maps still name the source: MOVED
        assert await batch.call(INCR, [key], []) == [key.encode(), 2]
        assert (await window.try_acquire(tenant_key(name), 10)).remaining == 8
        assert node_get(target, key) == b"2"
        cluster.migrate_slot(slot, other, finish=False)  # keys moved, slot still the target's: ASK
        assert await batch.call(INCR, [key], []) == [key.encode(), 3]
        assert (await window.try_acquire(tenant_key(name), 10)).remaining == 7
        cluster.migrate_slot(slot, other)  # finished: the key the ASKed script wrote is on the new owner
        assert node_get(other, key) == b"3"
        assert await batch.call(INCR, [key], []) == [key.encode(), 4]
    finally:
        await batch.close()
        await window.close()


async def test_the_sharing_store_exchanges_and_pushes_on_the_cluster(cluster: RedisClusterTopology) -> None:
    def store() -> RedisShareStore:  # the shape extproc/app.py builds
        return RedisShareStore(make_redis_client(cluster.url, 1.0, batch=True, cluster=True),
                               make_redis_client(cluster.url, 1.0, batch=True, cluster=True))

    a, b = store(), store()
    pushes: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()

    async def listen() -> None:
        async for push in b.pushes("b"):
            await pushes.put(push)

    listener = asyncio.create_task(listen())
    try:
        assert await b.exchange("b", b"B", 2000) == []
        got = await a.exchange("a", b"A|1", 2000)
        assert [(peer, share) for peer, _, share in got] == [("b", b"B")]
        assert [(peer, share) for peer, _, share in await b.exchange("b", b"B", 2000)] == [("a", b"A|1")]
        async with asyncio.timeout(10):
            while True:  # until b's subscription is made, then a's next share reaches it pushed
                await a.exchange("a", b"A|2", 2000, read=False)
                try:
                    push = await asyncio.wait_for(pushes.get(), 0.2)
                except TimeoutError:
                    continue
                if push == ("a", b"A|2"):
                    break
        await a.leave("a")
        assert await b.exchange("b", b"B", 2000) == []
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await a.close()
        await b.close()


async def retry_until_ok(call: Callable[[], Awaitable[object]], seconds: float) -> float:
    """Seconds until `call()` stops raising RedisUnavailable."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with asyncio.timeout(seconds):
        while True:
            try:
                await call()
                return loop.time() - start
            except RedisUnavailable:
                await asyncio.sleep(0.05)


async def test_a_killed_masters_calls_fail_then_succeed_after_the_failover(cluster: RedisClusterTopology) -> None:
    """Last in the module: it kills a master, and restores the topology after."""
    victim, survivor = spread_tenants(cluster)[:2]
    key, safe = f"k:{{{victim}}}", f"k:{{{survivor}}}"
    batch = batch_client(cluster, 0.5)
    window = RedisWindow(lambda: make_redis_client(cluster.url, 0.5, cluster=True), timeout_s=0.5)
    try:
        assert await batch.call(INCR, [key], []) == [key.encode(), 1]
        assert (await window.try_acquire(tenant_key(victim), 100)).allowed
        cluster.kill_master_of(key)
        with pytest.raises(RedisUnavailable):
            await batch.call(INCR, [key], [])
        with pytest.raises(RedisUnavailable):
            await window.try_acquire(tenant_key(victim), 100)
        # Before the cluster marks it failed (node timeout 1 s), another master's items still answer.
        assert (await batch.call(INCR, [safe], []))[0] == safe.encode()
        await asyncio.to_thread(cluster.wait_for_failover, 20.0)
        # The same batcher and client, no restart: served by the promoted replica within a slot-map refresh.
        assert await retry_until_ok(lambda: batch.call(INCR, [key], []), 5.0) < 5.0
        assert await retry_until_ok(lambda: window.try_acquire(tenant_key(victim), 100), 5.0) < 5.0
        assert int(node_get(cluster.master_of(key), key) or 0) >= 2  # the first INCR was replicated
    finally:
        await batch.close()
        await window.close()
        cluster.restore()
