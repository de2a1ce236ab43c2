"""Client CPU and latency per budgeted request on a standalone Redis, a Sentinel topology and a Redis
Cluster, side by side in one run.

Each topology is real and on loopback (modeldock.devstack: `RedisServer`; `RedisSentinel`, 1 master, 1
replica, 3 Sentinels; `RedisClusterTopology`, 3 masters with a replica each). Per topology and variant,
this process runs requests as the gateway does and reports its own CPU per request (µs) and the wall
time of one request (p50, p99), serially and with 16 tasks at once. Variants and topologies alternate
round by round; per cell the best round's CPU counts (noise only adds), and its latencies with it.

  window         the request window: one `RedisWindow.try_acquire_all` of a tenant and a per-model limit
                 (one Lua script call, awaited, on the request path)
  budgets        `TokenBudgets.reserve` + `finish_nowait` with token leases on (the default): most requests
                 admitted from a block reserved in Redis, no round trip of their own
  budgets-exact  the same without leases (`token_lease_ms: 0`): one batched reserve per request

Target (issue "Shared state on the Redis a platform team already runs"): cluster and Sentinel within
1.2x of standalone. Writes the `redis-topologies` section of docs/benchmarks.md unless --no-write.

    .venv/bin/python -m benchmarks.redis_topologies [--requests 2000] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from typing import Any

from benchmarks._report import table, write_section
from modeldock.admission.redis_window import RedisWindow, model_key, tenant_key
from modeldock.bench.stats import nearest_rank
from modeldock.budgets.budgets import TokenBudgets
from modeldock.budgets.tokens import Usage
from modeldock.clock import SystemClock
from modeldock.config import Config, LimitsConfig, ModelConfig, TenantConfig, hash_key
from modeldock.devstack.redis_sentinel import RedisSentinel
from modeldock.devstack.redis_server import RedisServer
from modeldock.redis_client import make_redis_client

COMMAND = ".venv/bin/python -m benchmarks.redis_topologies"
TIMEOUT_S = 1.0
BIG = 10**12
_ids = itertools.count()

Request = Callable[[], Awaitable[None]]
Setup = Callable[[], Awaitable[tuple[Request, Callable[[], Awaitable[None]]]]]


def limits(url: str, cluster: bool, **extra: Any) -> LimitsConfig:
    fields: dict[str, Any] = {"redis_url": url, "redis_timeout_ms": round(TIMEOUT_S * 1000), **extra}
    if cluster:
        fields["redis_cluster"] = True
    return LimitsConfig(**fields)


async def window_requests(url: str, cluster: bool) -> tuple[Request, Callable[[], Awaitable[None]]]:
    config = limits(url, cluster)
    extra: dict[str, Any] = {"cluster": True} if cluster else {}
    window = RedisWindow(lambda: make_redis_client(config.redis_url or "", TIMEOUT_S, **extra), timeout_s=TIMEOUT_S)
    tenant = f"t{next(_ids)}"
    keys = [(tenant_key(tenant), BIG), (model_key(tenant, "m"), BIG)]

    async def request() -> None:
        decisions = await window.try_acquire_all(keys)
        assert decisions[0].allowed

    return request, window.close


async def budget_requests(url: str, cluster: bool, lease_ms: int) -> tuple[Request, Callable[[], Awaitable[None]]]:
    tenant = TenantConfig(id=f"t{next(_ids)}", api_key_hashes=[hash_key("k")], models=["*"],
                          tokens_per_minute=BIG, tokens_per_day=BIG)
    config = Config(tenants=[tenant], models=[ModelConfig(name="m", endpoints=["127.0.0.1:8000"])],
                    limits=limits(url, cluster, token_lease_ms=lease_ms))
    budgets = TokenBudgets(config, SystemClock())

    async def request() -> None:
        reservation = await budgets.reserve(tenant, "m", 100, f"q{next(_ids)}")
        reservation.finish_nowait(reached_backend=True, usage=Usage(prompt_tokens=20, completion_tokens=30))

    return request, budgets.close


async def measure(setup: Setup, requests: int, concurrency: int) -> tuple[float, list[float]]:
    """(CPU µs per request, wall seconds of each request)."""
    run, close = await setup()
    walls: list[float] = []
    try:
        per_worker = max(requests // concurrency, 1)

        async def worker(record: bool) -> None:
            for _ in range(per_worker):
                started = time.perf_counter()
                await run()
                if record:
                    walls.append(time.perf_counter() - started)

        await asyncio.gather(*(worker(False) for _ in range(concurrency)))  # warm: connections, scripts, slots
        cpu = time.process_time()
        await asyncio.gather(*(worker(True) for _ in range(concurrency)))
        return (time.process_time() - cpu) / (per_worker * concurrency) * 1e6, walls
    finally:
        await close()


def cluster_topology() -> Any:
    """The Cluster topology, or None where this checkout has no Cluster support yet."""
    try:
        from modeldock.devstack.redis_cluster import RedisClusterTopology
    except ImportError:
        return None
    if "redis_cluster" not in LimitsConfig.model_fields:
        return None
    return RedisClusterTopology()


async def run(urls: dict[str, tuple[str, bool]], requests: int, rounds: int) -> dict[tuple[str, str, int], Any]:
    variants: dict[str, Callable[[str, bool], Awaitable[tuple[Request, Callable[[], Awaitable[None]]]]]] = {
        "window": window_requests,
        "budgets": lambda url, cluster: budget_requests(url, cluster, 1000),
        "budgets-exact": lambda url, cluster: budget_requests(url, cluster, 0),
    }
    best: dict[tuple[str, str, int], tuple[float, list[float]]] = {}
    for _ in range(rounds):
        for variant, make in variants.items():
            for topology, (url, cluster) in urls.items():
                for concurrency in (1, 16):
                    cpu, walls = await measure(lambda m=make, u=url, c=cluster: m(u, c), requests, concurrency)
                    key = (variant, topology, concurrency)
                    if key not in best or cpu < best[key][0]:
                        best[key] = (cpu, walls)
    return best


def report(best: dict[tuple[str, str, int], Any], topologies: list[str], requests: int, rounds: int) -> str:
    rows, ratios = [], []
    for (variant, topology, concurrency), (cpu, walls) in best.items():
        base = best[(variant, "standalone", concurrency)][0]
        ratio = cpu / base
        if topology != "standalone":
            ratios.append((ratio, variant, topology, concurrency))
        rows.append([variant, topology, concurrency, f"{cpu:.1f}", f"{ratio:.2f}x",
                     f"{nearest_rank(walls, 50) * 1e6:.0f}", f"{nearest_rank(walls, 99) * 1e6:.0f}"])
    worst = max(ratios) if ratios else None
    verdict = (f"The largest ratio to standalone is {worst[0]:.2f}x ({worst[1]}, {worst[2]}, c={worst[3]}): "
               + ("within" if worst[0] <= 1.2 else "over") + " the 1.2x target." if worst else "")
    missing = "" if "cluster" in topologies else " (no Cluster in this run)"
    return "\n\n".join([
        f"Topologies: {', '.join(topologies)}{missing}, all on loopback. {requests} requests per cell and round, "
        f"variants and topologies alternating, best of {rounds} rounds by CPU. CPU is this process's (the "
        f"client's) per request; latency is one request's wall time (µs). Variants in the script's docstring.",
        table(["variant", "topology", "tasks", "client CPU µs / request", "CPU vs standalone", "p50 µs", "p99 µs"],
              rows),
        verdict,
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="requests per cell and round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--topologies", default="standalone,sentinel,cluster",
                        help="which to run (standalone is always run: the ratios are to it)")
    args = parser.parse_args()
    chosen = set(args.topologies.split(","))
    with ExitStack() as stack:
        urls: dict[str, tuple[str, bool]] = {"standalone": (stack.enter_context(RedisServer().start()).url, False)}
        if "sentinel" in chosen:
            urls["sentinel"] = (stack.enter_context(RedisSentinel().start()).url, False)
        cluster = cluster_topology() if "cluster" in chosen else None
        if cluster is not None:
            urls["cluster"] = (stack.enter_context(cluster.start()).url, True)
        best = asyncio.run(run(urls, args.requests, args.rounds))
    body = report(best, list(urls), args.requests, args.rounds)
    print(body)
    if not args.no_write:
        write_section("redis-topologies", "Redis topologies: client CPU and latency per budgeted request",
                      COMMAND, body)


if __name__ == "__main__":
    main()
