"""What scraping costs one ext_proc: CPU share of one core and sample age, before against now.

One process holds what ext_proc holds for scraping (a Picker with every endpoint in one model, a
Scraper fed by it, the picker's release listener wired to `Scraper.refresh` and, now, its claim
listener to `Scraper.hurry`, as `extproc/app.py` wires them) and scrapes N endpoints. Another
serves them: N static ~35 KB vLLM-like pages on N loopback ports (`tests/support/page_server.py`,
a raw asyncio protocol, so the server costs little). Two loads:

- `idle`: nothing in flight;
- `load`: a tenth of the endpoints hold one request each, and every one of those ends and is
  replaced once a second on average (a release, then a pick of the same endpoint).

Two sides, alternated case by case in one run (the order swapped every other case):

- `before`: the scraper and parser at commit BEFORE, loaded from git (fixed 0.5 s rounds of every
  endpoint, the whole page parsed);
- `now`: this checkout, from the default config (`Scraper.from_config`: adaptive intervals, the
  early-stopping parser, the session of `scrape.new_session`).

The scraping process measures its own CPU from /proc over the measured seconds (after a warm-up)
and samples every endpoint's sample age every 50 ms: p99 over the endpoints in use (a request
there), and the oldest over the idle ones (against the stale cutoff, 2 s).

    .venv/bin/python -m benchmarks.scrape_cost [--sizes 100,1000,3000] [--seconds 15] [--warmup 4] [--no-write]
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
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._proc import cpu_seconds, rss_mb
from benchmarks._report import table, write_section
from modeldock.types import Endpoint

BEFORE = "d2218a2"  # the last commit before adaptive scraping
MODEL = "/models/meta-llama/Llama-3.3-70B-Instruct"
PAGE_BYTES = 35 * 1024
BUSY_SHARE = 0.1
TARGET_CPU = 0.10  # of one core, at 1,000 endpoints
TARGET_AGE = 1.0  # seconds, p99 for the endpoints in use
ROOT = Path(__file__).resolve().parent.parent


def page(waiting: int = 0, running: int = 0) -> str:
    """A one-engine vLLM page cut to ~35 KB (a real one's size): histogram families dropped from the
    last until it fits; the load gauges, the token counters and cache_config_info stay."""
    from tests.support.vllm_page import vllm_metrics_page

    text = vllm_metrics_page(MODEL, waiting=(float(waiting),), running=(float(running),), kv=(0.3,))
    head, *families = text.split("# HELP ")
    blocks = ["# HELP " + f for f in families]
    while sum(map(len, blocks)) + len(head) > PAGE_BYTES:
        last = max(i for i, b in enumerate(blocks) if b.split("\n", 2)[1].endswith(" histogram"))
        del blocks[last]
    return head + "".join(blocks)


# -- the page server (its own process) --------------------------------------------------------------

async def _serve(n: int) -> None:
    from tests.support.page_server import PageServer

    server = PageServer()
    sites = await server.start(n, page(waiting=0, running=4))
    print(json.dumps([s.endpoint.port for s in sites]), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
    await server.close()


# -- the scraping process ---------------------------------------------------------------------------

def _before_modules() -> tuple[Any, Any]:
    """scrape.py and parse.py as they were at BEFORE, the scraper bound to that parser."""
    def load(name: str, path: str) -> types.ModuleType:
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{BEFORE}:{path}"], capture_output=True,
                                text=True, check=True, timeout=30).stdout
        module = types.ModuleType(name)
        sys.modules[name] = module  # dataclasses look their module up while the source runs
        exec(compile(source, f"{BEFORE}:{path}", "exec"), module.__dict__)
        return module

    parse = load("_before_parse", "modeldock/picking/parse.py")
    scrape = load("_before_scrape", "modeldock/picking/scrape.py")
    scrape.parse_metrics = parse.parse_metrics
    return scrape, parse


async def _scrape(ports: list[int], side: str, loaded: bool, seconds: float, warmup: float) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry

    from modeldock.clock import SystemClock
    from modeldock.picking.config import RoutingConfig
    from modeldock.picking.factory import build_picker
    from modeldock.picking.ledger import Lease
    from modeldock.picking.scrape import Scraper

    clock = SystemClock()
    routing = RoutingConfig()
    registry = CollectorRegistry()
    picker = build_picker(routing, clock, registry)
    eps = [Endpoint("127.0.0.1", port) for port in ports]
    picker.set_endpoints("m", eps, served_name=MODEL)
    scrape = routing.scrape
    scraper: Any
    if side == "before":
        module, _ = _before_modules()
        scraper = module.Scraper(picker, clock, interval=scrape.interval_seconds, timeout=scrape.timeout_seconds,
                                 budget=scrape.budget_seconds, registry=registry,
                                 refresh_gap=scrape.refresh_gap_seconds)
    else:
        scraper = Scraper.from_config(picker, clock, routing, registry=registry)
        picker.add_claim_listener(scraper.hurry)
    picker.add_release_listener(scraper.refresh)
    reads = [0]
    observe = picker.observe

    def counted(*args: Any, **kwargs: Any) -> None:  # pages applied, rounds' and out of turn alike
        reads[0] += 1
        observe(*args, **kwargs)

    picker.observe = counted  # type: ignore[method-assign]
    rng = random.Random(7)
    busy = rng.sample(eps, max(1, int(len(eps) * BUSY_SHARE))) if loaded else []
    leases: dict[Endpoint, Lease] = {}

    def claim(ep: Endpoint) -> None:
        leases[ep] = picker.pick("m", subset=frozenset({ep})).lease

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
        churn_started = time.thread_time()
        for _ in range(sum(1 for _ in busy if rng.random() < tick)):  # each ends about once a second
            ep = rng.choice(busy)
            leases.pop(ep).release()  # the release listener schedules a read out of turn
            claim(ep)
        if measuring:  # the picks' own CPU (a pick by subset scans the pool) is not scraping's
            probe += time.thread_time() - churn_started
        if measuring:  # the probe's own CPU is taken off the figure
            probe_started = time.thread_time()
            mono = clock.monotonic()
            in_use = set(busy)
            for ep in eps:
                age = mono - picker.load(ep).taken_at
                if ep in in_use:
                    ages_busy.append(age)
                else:
                    oldest_idle = max(oldest_idle, age)
                    stale += age > routing.stale_after_seconds
            probe += time.thread_time() - probe_started
    cpu = cpu_seconds(os.getpid()) - cpu0 - probe
    wall = time.monotonic() - wall0
    for lease in leases.values():
        lease.release()
    await scraper.stop()
    ages_busy.sort()
    errors = sum(v for _, v in _samples(registry, "modeldock_scrape_errors_total"))
    return {
        "cpu": cpu / wall, "wall": wall,
        "age_p99": ages_busy[int(0.99 * (len(ages_busy) - 1))] if ages_busy else None,
        "oldest_idle": oldest_idle, "stale_idle": stale, "reads": reads[0] - reads0, "probe": probe / wall,
        "errors": errors,
        "rss_mb": rss_mb(os.getpid()),
    }


def _samples(registry: Any, name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for metric in registry.collect() for s in metric.samples if s.name == name]


# -- the parent: alternate the sides, report ratios -------------------------------------------------

def _case(ports_file: str, n: int, side: str, loaded: bool, seconds: float, warmup: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.scrape_cost", "--child", ports_file, "--n", str(n), "--side", side,
               "--seconds", str(seconds), "--warmup", str(warmup)] + (["--loaded"] if loaded else [])
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT,
                         timeout=warmup + seconds + 120)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _age(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} s"


def run(sizes: list[int], seconds: float, warmup: float, say: Callable[[str], None] = print) -> str:
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.scrape_cost", "--serve", str(max(sizes))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    rows: list[list[object]] = []
    try:
        assert server.stdout is not None
        ports = json.loads(server.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            flip = False
            for n in sizes:
                ports_file = str(Path(tmp) / f"ports-{n}.json")
                Path(ports_file).write_text(json.dumps(ports[:n]))
                for loaded in (False, True):
                    sides = ("now", "before") if flip else ("before", "now")
                    flip = not flip
                    got = {side: _case(ports_file, n, side, loaded, seconds, warmup) for side in sides}
                    b, a = got["before"], got["now"]
                    say(f"n={n} {'load' if loaded else 'idle'}: before {json.dumps(b)}\n    now {json.dumps(a)}")
                    rows.append([
                        f"{n:,}", "load" if loaded else "idle", _pct(b["cpu"]), _pct(a["cpu"]),
                        f"{a['cpu'] / b['cpu']:.2f}x",
                        f"{b['reads'] / b['wall']:.0f} / {a['reads'] / a['wall']:.0f}" if b["wall"] and a["wall"]
                        else "-",
                        f"{_age(b['age_p99'])} / {_age(a['age_p99'])}" if loaded else "-",
                        f"{_age(a['oldest_idle'])} ({a['stale_idle']})",
                        f"{b['errors']:.0f} / {a['errors']:.0f}",
                    ])
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
    at_1000 = [r for r in rows if r[0] == "1,000"]
    return (
        f"One process scraping N endpoints (one model; the page server in another process, ~35 KB pages), "
        f"{seconds:g} s measured after a {warmup:g} s warm-up, CPU from /proc. `before`: the scraper and parser of "
        f"commit {BEFORE} (every endpoint every 0.5 s, the whole page parsed); `now`: the default config "
        "(adaptive intervals: an endpoint with nothing in flight here and no queue every "
        f"`routing.idle_interval` = 1.25 s, busy ones every 0.5 s, the parser stopping after the families it reads). "
        f"`load`: {BUSY_SHARE:.0%} of the endpoints hold a request, each ending and replaced about once a second "
        "(a read out of turn at each ending, both sides). Sample age: p99 over the endpoints in use, sampled every "
        "50 ms; the oldest idle sample now, with how many samples were past the 2 s stale cutoff. "
        f"Targets: at most {TARGET_CPU:.0%} of one core at 1,000 endpoints, age p99 at most {TARGET_AGE:g} s.\n\n"
        + table(["endpoints", "load", "CPU before", "CPU now", "now / before", "reads/s before / now",
                 "age p99 in use, before / now", "oldest idle now (stale)", "errors before / now"], rows)
        + ("\n\nAt 1,000 endpoints: " + "; ".join(f"{r[1]} {r[3]} of one core ({r[4]} of before)" for r in at_1000)
           if at_1000 else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100,1000,3000")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=("before", "now"), help=argparse.SUPPRESS)
    parser.add_argument("--loaded", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(_serve(args.serve))
        return
    if args.child:
        ports = json.loads(Path(args.child).read_text())[: args.n]
        print(json.dumps(asyncio.run(_scrape(ports, args.side, args.loaded, args.seconds, args.warmup))))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    body = run(sizes, args.seconds, args.warmup)
    print(body)
    if not args.no_write:
        command = ".venv/bin/python -m benchmarks.scrape_cost"
        if args.sizes != "100,1000,3000" or args.seconds != 15.0:
            command += f" --sizes {args.sizes} --seconds {args.seconds:g}"
        write_section("scrape-cost", "Scraping: CPU and sample age at 100 to 3,000 endpoints", command, body)


if __name__ == "__main__":
    main()
