"""Scraping with several replicas: each reads every page, against one owner per page that relays it.

Two replica processes, side by side, each with what ext_proc holds for picking (a Picker over N
endpoints of one model, its Scraper from the default config) and the shared load state on one real
Redis (`Sharing`, the default `sharing:` config), so both sides pay for the exchanges:

- `each reads all`: `sharing.split_scraping: false`, every replica reads every page (before);
- `split`: the default, each page read by its owner among the live replicas and relayed in its share
  (sharing/split.py, picking/relay.py).

The pages come from `benchmarks.scrape_cost`'s page server (another process, ~35 KB pages). Each
replica process measures its own CPU from /proc over the measured seconds and samples, every 50 ms,
how old its sample of every endpoint is (read by itself or relayed): p99 over the endpoints it has
requests on, and the oldest idle one against the 2 s stale cutoff. `load`: each replica holds a
request on a tenth of the endpoints (its own tenth), each ending and replaced about once a second.

    .venv/bin/python -m benchmarks.scrape_replicas [--n 1000] [--replicas 2] [--seconds 15] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._proc import cpu_seconds
from benchmarks._report import table, write_section
from modeldock.types import Endpoint

ROOT = Path(__file__).resolve().parent.parent
MODEL = "/models/meta-llama/Llama-3.3-70B-Instruct"
BUSY_SHARE = 0.1


async def _replica(ports: list[int], name: str, redis_url: str, split: bool, loaded: bool, seconds: float,
                   warmup: float) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry

    from modeldock.clock import SystemClock
    from modeldock.config import parse_config
    from modeldock.extproc.app import _split_scraping
    from modeldock.picking.factory import build_picker
    from modeldock.picking.ledger import Lease
    from modeldock.picking.scrape import Scraper
    from modeldock.redis_client import make_redis_client
    from modeldock.sharing.store import RedisShareStore
    from modeldock.sharing.sync import Sharing

    config = parse_config({"models": [{"name": "m", "endpoints": []}],
                           "sharing": {"split_scraping": split, "replica": name}})
    clock = SystemClock()
    registry = CollectorRegistry()
    picker = build_picker(config.routing, clock, registry)
    eps = [Endpoint("127.0.0.1", port) for port in ports]
    picker.set_endpoints("m", eps, served_name=MODEL)
    scraper = Scraper.from_config(picker, clock, config.routing, registry=registry)
    picker.add_claim_listener(scraper.hurry)
    picker.add_release_listener(scraper.refresh)
    timeout = config.sharing.timeout_ms / 1000.0
    store = RedisShareStore(make_redis_client(redis_url, timeout, batch=True),
                            make_redis_client(redis_url, timeout, batch=True))
    sharing = Sharing(picker, store, clock, config.sharing, registry, pages=picker if split else None)
    picker.add_claim_listener(sharing.changed)
    picker.add_release_listener(sharing.changed)
    if split:
        _split_scraping(config, picker, scraper, sharing)
    reads = [0]
    observe = picker.observe

    def counted(*args: Any, **kwargs: Any) -> None:  # this replica's own reads (relayed pages go around)
        reads[0] += 1
        observe(*args, **kwargs)

    picker.observe = counted  # type: ignore[method-assign]
    rng = random.Random(name)
    busy = rng.sample(eps, max(1, int(len(eps) * BUSY_SHARE))) if loaded else []
    leases: dict[Endpoint, Lease] = {}

    def claim(ep: Endpoint) -> None:
        leases[ep] = picker.pick("m", subset=frozenset({ep})).lease

    sharing.start()
    scraper.start()
    for ep in busy:
        claim(ep)
    ages_busy: list[float] = []
    oldest_idle = 0.0
    stale = 0
    loop = asyncio.get_running_loop()
    started = loop.time()
    cpu0 = wall0 = probe = 0.0
    reads0 = 0
    measuring = False
    tick = 0.05
    while True:
        await asyncio.sleep(tick)
        now = loop.time()
        if not measuring and now - started >= warmup:
            measuring, cpu0, wall0, reads0 = True, cpu_seconds(os.getpid()), time.monotonic(), reads[0]
        if now - started >= warmup + seconds:
            break
        probe_started = time.thread_time()
        for _ in range(sum(1 for _ in busy if rng.random() < tick)):  # each ends about once a second
            ep = rng.choice(busy)
            leases.pop(ep).release()
            claim(ep)
        if measuring:  # the picks' and the probe's own CPU are taken off the figure
            mono = clock.monotonic()
            in_use = set(busy)
            for ep in eps:
                age = mono - picker.load(ep).taken_at
                if ep in in_use:
                    ages_busy.append(age)
                else:
                    oldest_idle = max(oldest_idle, age)
                    stale += age > config.routing.stale_after_seconds
            probe += time.thread_time() - probe_started
    cpu = cpu_seconds(os.getpid()) - cpu0 - probe
    wall = time.monotonic() - wall0
    relayed = registry.get_sample_value("modeldock_sharing_pages_total") or 0.0
    peers = registry.get_sample_value("modeldock_sharing_peers") or 0.0  # before anyone leaves
    for lease in leases.values():
        lease.release()
    await scraper.stop()
    await sharing.stop()
    ages_busy.sort()
    return {"cpu": cpu / wall, "reads": (reads[0] - reads0) / wall, "relayed": relayed, "peers": peers,
            "age_p99": ages_busy[int(0.99 * (len(ages_busy) - 1))] if ages_busy else None,
            "oldest_idle": oldest_idle, "stale": stale}


def _side(ports_file: str, n: int, replicas: int, redis_url: str, split: bool, loaded: bool, seconds: float,
          warmup: float) -> list[dict[str, Any]]:
    procs = []
    for i in range(replicas):
        command = [sys.executable, "-m", "benchmarks.scrape_replicas", "--child", ports_file, "--n", str(n),
                   "--name", f"r{i}", "--redis", redis_url, "--seconds", str(seconds), "--warmup", str(warmup)]
        command += (["--split"] if split else []) + (["--loaded"] if loaded else [])
        procs.append(subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT))
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=warmup + seconds + 120)
        if proc.returncode != 0:
            raise RuntimeError(f"replica exited with {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _age(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def run(n: int, replicas: int, seconds: float, warmup: float) -> str:
    from modeldock.devstack.redis_server import RedisServer

    redis = RedisServer().start()
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.scrape_cost", "--serve", str(n)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    rows: list[list[object]] = []
    ratios: list[str] = []
    try:
        assert server.stdout is not None
        ports = json.loads(server.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            ports_file = str(Path(tmp) / "ports.json")
            Path(ports_file).write_text(json.dumps(ports[:n]))
            flip = False
            for loaded in (False, True):
                order = (True, False) if flip else (False, True)
                flip = not flip
                got = {split: _side(ports_file, n, replicas, redis.url, split, loaded, seconds, warmup)
                       for split in order}
                for split in (False, True):
                    results = got[split]
                    print(f"{'load' if loaded else 'idle'} split={split}: {json.dumps(results)}", flush=True)
                    ages = [r["age_p99"] for r in results if r["age_p99"] is not None]
                    rows.append([
                        "load" if loaded else "idle", "split" if split else "each reads all",
                        f"{100 * sum(r['cpu'] for r in results):.1f}%",
                        f"{sum(r['reads'] for r in results):.0f}",
                        _age(max(ages) if ages else None),
                        f"{_age(max(r['oldest_idle'] for r in results))} ({sum(r['stale'] for r in results)})",
                        f"{max(r['peers'] for r in results):.0f}",
                    ])
                all_cpu = sum(r["cpu"] for r in got[False])
                split_cpu = sum(r["cpu"] for r in got[True])
                ratios.append(f"{'load' if loaded else 'idle'}: split / each reads all = {split_cpu / all_cpu:.2f}x "
                              "of the replicas' CPU together")
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        redis.stop()
    return (
        f"{replicas} replica processes, {n:,} endpoints of one model (~35 KB pages from another process), one real "
        f"Redis for the shared load state (default `sharing:`), {seconds:g} s measured after {warmup:g} s. CPU: the "
        "replicas' together, in share of one core, each from /proc (scraping, parsing and the exchanges). "
        "Reads/s: pages the replicas read themselves, together. Sample age: the worst replica's p99 over the "
        "endpoints it has requests on, read or relayed; the oldest idle sample, with how many samples were past "
        "the 2 s stale cutoff.\n\n"
        + table(["load", "scraping", "CPU, replicas together", "reads/s", "age p99 in use", "oldest idle (stale)",
                 "peers seen"], rows)
        + "\n\n" + "; ".join(ratios)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--redis", help=argparse.SUPPRESS)
    parser.add_argument("--split", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--loaded", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        ports = json.loads(Path(args.child).read_text())[: args.n]
        print(json.dumps(asyncio.run(_replica(ports, args.name, args.redis, args.split, args.loaded, args.seconds,
                                              args.warmup))))
        return
    body = run(args.n, args.replicas, args.seconds, args.warmup)
    print(body)
    if not args.no_write:
        command = ".venv/bin/python -m benchmarks.scrape_replicas"
        if (args.n, args.replicas, args.seconds) != (1000, 2, 15.0):
            command += f" --n {args.n} --replicas {args.replicas} --seconds {args.seconds:g}"
        write_section("scrape-replicas", "Scraping with replicas: one reader per page, relayed", command, body)


if __name__ == "__main__":
    main()
