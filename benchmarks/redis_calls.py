"""Client CPU per token-budget script call to a real Redis, by call shape, side by side.

Each variant runs the budget scripts (RESERVE_LUA, then SETTLE_LUA for the same id, two windows as a
tenant with a per-minute and a per-day budget) against a redis-server on loopback and reports this
process's CPU per reserve+settle pair (µs), serially and with 16 tasks at once. Variants alternate
round by round; the best round counts (noise only adds).

  script-blocking   redis-py Script call per script, BlockingConnectionPool (the shape before batching)
  script-plain      the same on a plain ConnectionPool
  pipe-script-K     K pairs per non-transactional pipeline, queued with Script(client=pipe)
                    (redis-py then sends SCRIPT EXISTS before every pipeline)
  pipe-evalsha-K    K pairs per pipeline, queued as EVALSHA
  batcher           modeldock.admission.redis_batch.RedisBatch: reserve awaited, settle deferred
  budgets-local     TokenBudgets.reserve + finish_nowait per request, local windows only (per request)
  budgets-redis     the same with the windows in Redis (token leases on, the default): what the Redis
                    budget adds per request
  budgets-redis-exact  the same without leases (token_lease_ms: 0): one reserve round trip per request
  ping-floor        one bare PING round trip per pair on a held connection (the floor of any shape)
  *-lean            a plain ConnectionPool without socket_timeout (the call is bounded by asyncio.timeout)

The header says which parser ran (hiredis comes with `redis[hiredis]`). Writes the `redis-calls`
section of docs/benchmarks.md (not with --no-write or --only).

    .venv/bin/python -m benchmarks.redis_calls [--pairs 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.utils import HIREDIS_AVAILABLE

from benchmarks._report import table, write_section
from modeldock.admission.redis_window import run_script
from modeldock.budgets.budgets import TokenBudgets
from modeldock.budgets.redis_batch import RedisBatch, Script
from modeldock.budgets.redis_window import RESERVE_LUA, SETTLE_LUA
from modeldock.budgets.tokens import Usage
from modeldock.clock import SystemClock
from modeldock.config import Config, LimitsConfig, ModelConfig, TenantConfig, hash_key
from modeldock.devstack.redis_server import RedisServer
from modeldock.redis_client import make_redis_client

KEYS = ["bench:{t}:minute", "bench:{t}:minute:amt", "bench:{t}:day", "bench:{t}:day:amt"]
TIMEOUT_S = 1.0
_ids = itertools.count()

Pair = Callable[[], Awaitable[None]]


def reserve_args(rid: str) -> list[int | str]:
    return [rid, 10, "", 10, 60_000_000, 10**12, 86_400_000_000, 10**12]  # id, cost, now, want, windows


def settle_args(rid: str) -> list[int | str]:
    return [rid, 7, "", 60_000_000, 86_400_000_000]


def plain_client(url: str, socket_timeout: float | None = TIMEOUT_S) -> Redis:  # redis-py's default: 5 s
    """A plain ConnectionPool; `socket_timeout=None` leaves the bound to the caller's asyncio.timeout
    (redis-py wraps every send in asyncio.wait_for, a task per command, when it is set)."""
    pool = ConnectionPool.from_url(url, max_connections=64, socket_timeout=socket_timeout,
                                   socket_connect_timeout=TIMEOUT_S, retry=Retry(NoBackoff(), 1))
    return Redis.from_pool(pool)


async def script_pairs(client: Redis) -> tuple[Pair, Callable[[], Awaitable[None]]]:
    reserve, settle = client.register_script(RESERVE_LUA), client.register_script(SETTLE_LUA)

    async def pair() -> None:
        rid = f"r{next(_ids)}"
        await run_script(reserve, KEYS, reserve_args(rid), TIMEOUT_S)
        await run_script(settle, KEYS, settle_args(rid), TIMEOUT_S)

    return pair, client.aclose


async def pipeline_batches(client: Redis, k: int, via_script: bool) -> tuple[Pair, Callable[[], Awaitable[None]]]:
    reserve, settle = client.register_script(RESERVE_LUA), client.register_script(SETTLE_LUA)
    await client.script_load(RESERVE_LUA)
    await client.script_load(SETTLE_LUA)

    async def batch() -> None:
        pipe = client.pipeline(transaction=False)
        for _ in range(k):
            rid = f"r{next(_ids)}"
            if via_script:
                await reserve(KEYS, reserve_args(rid), client=pipe)
                await settle(KEYS, settle_args(rid), client=pipe)
            else:
                pipe.evalsha(reserve.sha, len(KEYS), *KEYS, *reserve_args(rid))
                pipe.evalsha(settle.sha, len(KEYS), *KEYS, *settle_args(rid))
        async with asyncio.timeout(TIMEOUT_S):
            await pipe.execute(raise_on_error=True)

    return batch, client.aclose


async def batcher_pairs(factory: Callable[[], Redis]) -> tuple[Pair, Callable[[], Awaitable[None]]]:
    batch = RedisBatch(factory, timeout_s=TIMEOUT_S)
    reserve, settle = Script(RESERVE_LUA), Script(SETTLE_LUA)

    async def pair() -> None:
        rid = f"r{next(_ids)}"
        await batch.call(reserve, KEYS, reserve_args(rid))
        batch.defer(settle, KEYS, settle_args(rid), lambda _exc: None)

    return pair, batch.close


async def ping_floor(url: str) -> tuple[Pair, Callable[[], Awaitable[None]]]:
    """One bare PING per pair on a held connection: the round trip no call shape can go below."""
    client = plain_client(url, None)
    conn = await client.connection_pool.get_connection()
    ping = conn.pack_command("PING")

    async def pair() -> None:
        async with asyncio.timeout(TIMEOUT_S):
            await conn.send_packed_command(ping)
            await conn.read_response()

    async def close() -> None:
        await client.connection_pool.release(conn)
        await client.aclose()

    return pair, close


async def budget_requests(
    redis_url: str | None, lease_ms: int = 1000
) -> tuple[Pair, Callable[[], Awaitable[None]]]:
    """TokenBudgets as the gateway uses it: reserve on the request path, then settle without waiting."""
    tenant = TenantConfig(id="t", api_key_hashes=[hash_key("k")], models=["*"],
                          tokens_per_minute=10**12, tokens_per_day=10**12)
    config = Config(tenants=[tenant], models=[ModelConfig(name="m", endpoints=["127.0.0.1:8000"])],
                    limits=LimitsConfig(redis_url=redis_url, redis_timeout_ms=1000, token_lease_ms=lease_ms))
    budgets = TokenBudgets(config, SystemClock())

    async def request() -> None:
        reservation = await budgets.reserve(tenant, "m", 100, f"q{next(_ids)}")
        reservation.finish_nowait(reached_backend=True, usage=Usage(prompt_tokens=20, completion_tokens=30))

    return request, budgets.close


async def measure(make: Callable[[], Awaitable[tuple[Pair, Callable[[], Awaitable[None]]]]],
                  pairs: int, concurrency: int, per_call: int) -> float:
    """CPU µs per reserve+settle pair; `per_call` pairs are done by one call of the returned function."""
    run, close = await make()
    try:
        calls = max(pairs // per_call // concurrency, 1)

        async def worker() -> None:
            for _ in range(calls):
                await run()

        await asyncio.gather(*(worker() for _ in range(concurrency)))  # warm: connections, scripts
        started = time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        spent = time.process_time() - started
        return spent / (calls * concurrency * per_call) * 1e6
    finally:
        await close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2000, help="reserve+settle pairs per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated variant name prefixes to run (writes nothing)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    opts = parser.parse_args()
    server = RedisServer().start()
    url = server.url
    variants: dict[str, tuple[Callable[[], Awaitable[tuple[Pair, Callable[[], Awaitable[None]]]]], int, bool]] = {
        "budgets-local": (lambda: budget_requests(None), 1, True),
        "budgets-redis": (lambda: budget_requests(url), 1, True),
        "budgets-redis-exact": (lambda: budget_requests(url, 0), 1, True),
        "ping-floor": (lambda: ping_floor(url), 1, False),
        "script-blocking": (lambda: script_pairs(make_redis_client(url, TIMEOUT_S)), 1, True),
        "script-plain": (lambda: script_pairs(plain_client(url)), 1, True),
        "script-lean": (lambda: script_pairs(plain_client(url, None)), 1, True),
        "batcher": (lambda: batcher_pairs(lambda: make_redis_client(url, TIMEOUT_S)), 1, True),
        "batcher-lean": (lambda: batcher_pairs(lambda: plain_client(url, None)), 1, True),
    }
    for k in (1, 16, 64):
        variants[f"pipe-evalsha-{k}"] = (lambda k=k: pipeline_batches(make_redis_client(url, TIMEOUT_S), k, False),
                                         k, k == 1)
    variants["pipe-evalsha-1-lean"] = (lambda: pipeline_batches(plain_client(url, None), 1, False), 1, True)
    variants["pipe-evalsha-16-lean"] = (lambda: pipeline_batches(plain_client(url, None), 16, False), 16, False)
    variants["pipe-script-16"] = (lambda: pipeline_batches(make_redis_client(url, TIMEOUT_S), 16, True), 16, False)
    if opts.only:
        variants = {k: v for k, v in variants.items() if k.startswith(tuple(opts.only.split(",")))}
    best: dict[tuple[str, int], float] = {}
    try:
        for _ in range(opts.rounds):
            for name, (make, per_call, concurrent_too) in variants.items():
                for concurrency in (1, 16) if concurrent_too else (1,):
                    cpu = await measure(make, opts.pairs, concurrency, per_call)
                    key = (name, concurrency)
                    best[key] = min(best.get(key, cpu), cpu)
    finally:
        server.close()
    print(f"parser: {'hiredis' if HIREDIS_AVAILABLE else 'python'}; CPU µs per reserve+settle pair, best of "
          f"{opts.rounds} rounds")
    for name in variants:
        cells = [f"c={c}: {best[(name, c)]:7.1f}" for c in (1, 16) if (name, c) in best]
        print(f"  {name:20} " + "   ".join(cells))
    if opts.no_write or opts.only:
        return
    base = best.get(("script-blocking", 1))
    rows = []
    for name in variants:
        c1, c16 = best.get((name, 1)), best.get((name, 16))
        rows.append([f"`{name}`", f"{c1:.1f}" if c1 is not None else "-", f"{c16:.1f}" if c16 is not None else "-",
                     f"{c1 / base:.2f}x" if c1 is not None and base else "-"])
    body = (
        f"Client CPU (this process, µs) per reserve + settle of the token-budget scripts against a loopback "
        f"redis-server, by call shape; {opts.pairs} pairs per variant and round, variants alternating, best of "
        f"{opts.rounds} rounds. Parser: {'hiredis' if HIREDIS_AVAILABLE else 'python'}. The variants are described "
        f"in the script's docstring; `budgets-*` rows are per request through `TokenBudgets` (reserve + settle).\n\n"
        + table(["variant", "c=1", "c=16", "c=1 vs script-blocking"], rows)
        + "\n\nReading: `budgets-redis` is what a request with budgets in Redis costs now: token leases admit it "
          "from a block reserved in Redis, so it makes no round trip of its own (the lease's reserve and "
          "settlements are shared by the requests it admits). `budgets-redis-exact` is the same without "
          "leases (`limits.token_lease_ms: 0`): one batched reserve round trip per request (`batcher`); "
          "`script-blocking` is the shape before batching (one redis-py Script call per script); `ping-floor` is "
          "one bare round trip, the floor of any shape that waits for Redis on the request path."
    )
    write_section("redis-calls", "Token-budget Redis calls by shape (client CPU)",
                  ".venv/bin/python -m benchmarks.redis_calls", body)


if __name__ == "__main__":
    asyncio.run(main())
