"""The policies x workloads loop: one fresh stack per contender and rotation, every workload measured on
it (client timings, the simulators' counters, CPU per process), the Envoy access-log diagnostics, and the
client-side affinity reference run of `shared`."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._proc import cpu_seconds
from benchmarks.routing import envoy_log
from benchmarks.routing.driver import DriveResult, Timed, drive
from benchmarks.routing.stacks import MODEL, drive_model, sim_args, sim_stats, wait_idle, warm, with_routing
from benchmarks.routing.workloads import Request, Workload
from modeldock.bench.stats import nearest_rank
from modeldock.devstack.stack import API_KEY, http_json, running_stack, start_sims
from modeldock.up import Supervisor


def component(name: str) -> str:
    return "sims" if name.startswith("sim-") else name.split("-")[0]



def cpu_by_component(sup: Supervisor) -> dict[str, float]:
    out: dict[str, float] = {}
    for child in sup.children:
        name = component(child.name)
        out[name] = out.get(name, 0.0) + cpu_seconds(child.proc.pid)
    out["client"] = time.process_time()
    return out



@dataclass
class Run:
    """One workload sent once to one stack."""

    policy: str
    rotation: int
    workload: str
    timed: list[Timed]
    wall_s: float
    cpu_s: dict[str, float]
    load1: float  # 1-minute load average at the end
    received: list[int]  # requests each backend got
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    window: tuple[float, float] = (0.0, 0.0)  # unix time of the measured part
    diag: dict[str, float | None] = field(default_factory=dict)  # from Envoy's access log



def measure(policy: str, rotation: int, sup: Supervisor, sim_urls: Sequence[str], url: str | Sequence[str],
            token: str | None, workload: Workload, speed: float, route: Any = None) -> Run:
    """Send `workload` to `url`, or, with `route` (request -> index into `url`), each request to
    the URL its route gives (the affinity reference)."""
    before_stats, before_cpu = sim_stats(sim_urls), cpu_by_component(sup)
    begin = time.time() + 0.2 + workload.warmup / speed  # the driver starts 0.2 s after it is called
    if route is None:
        assert isinstance(url, str)
        result = asyncio.run(drive_model(url, token, workload.requests, speed))
    else:
        result = asyncio.run(_drive_routed(list(url), token, workload.requests, speed, route))
    end = time.time()
    after_stats, after_cpu = sim_stats(sim_urls), cpu_by_component(sup)

    def diff(key: str) -> list[int]:
        return [int(a[key] - b[key]) for a, b in zip(after_stats, before_stats, strict=True)]

    return Run(policy, rotation, workload.name, [t for t in result.timed if t.request.measured], result.wall_s,
               {k: after_cpu[k] - before_cpu.get(k, 0.0) for k in after_cpu}, os.getloadavg()[0],
               diff("received"), sum(diff("preemptions")), sum(diff("prefix_cache_queries")),
               sum(diff("prefix_cache_hits")), (begin, end))



LONG_TX = 40_000  # response bytes: a 1,000-token stream is ~200 KB, a 32-token one ~7 KB

BURST_RX = 6_000  # request bytes: burst prompts are 8-16 KB, background ones at most ~2.3 KB



def diagnose(runs: Sequence[Run], log: Path, slots: int) -> None:
    """Fill each run's `diag` from the stack's Envoy access log (read after the stack stopped, so it
    is flushed)."""
    if not log.exists():
        return
    entries = envoy_log.parse(log)
    for run in runs:
        begin, end = run.window
        mine = envoy_log.within(entries, begin, end)
        ups = [e.upstream for e in mine]
        run.diag = {
            "same_as_previous": (sum(1 for a, b in zip(ups, ups[1:], strict=False) if a == b) / (len(ups) - 1)
                                 if len(ups) > 1 else None),
            "over_slots": envoy_log.over_slots(entries, begin, end, slots),
            "peak_in_flight": float(envoy_log.peak([e for e in entries if e.end >= begin and e.start <= end])),
        }
        if run.workload == "mixed":
            live = [e for e in entries if e.end >= begin and e.start <= end]
            run.diag["peak_long"] = float(envoy_log.peak(live, lambda e: e.tx >= LONG_TX))
        if run.workload == "bursts":
            run.diag["burst_max"] = envoy_log.burst_max_mean(mine, BURST_RX)



async def _drive_routed(urls: list[str], token: str | None, requests: Sequence[Request], speed: float,
                        route: Any) -> DriveResult:
    from time import perf_counter

    start = perf_counter() + 0.3
    parts = await asyncio.gather(*(drive(u, MODEL, token, [r for r in requests if route(r) == i], speed,
                                         start_at=start) for i, u in enumerate(urls)))
    timed = sorted((t for p in parts for t in p.timed), key=lambda t: t.request.index)
    return DriveResult(timed, max(p.wall_s for p in parts))



def run_rotations(args: argparse.Namespace, workloads: Sequence[Workload], run_dir: Path) -> list[Run]:
    runs: list[Run] = []
    for rotation in range(args.rotations):
        order = args.lineup if rotation % 2 == 0 else args.lineup[::-1]
        for policy in order:
            print(f"rotation {rotation + 1}: {policy}", flush=True)
            with running_stack(run_dir / f"r{rotation}-{policy}", backends=args.backends, sim_args=sim_args(args),
                               edit_config=with_routing(args.routing[policy]), log_level="warning") as stack:
                urls = [s.url for s in stack.sims]
                if args.slow_factor != 1.0:  # an uneven pool: the last backend slower (or faster) than the rest
                    http_json("POST", f"{urls[-1]}/sim/speed", {"speed": args.speed * args.slow_factor})
                warm(stack.base_url, API_KEY)
                mine = []
                for workload in workloads:
                    wait_idle(urls, args.settle)
                    run = measure(policy, rotation, stack.sup, urls, stack.base_url, API_KEY, workload, args.speed)
                    mine.append(run)
                    print("  " + one_line(run), flush=True)
            diagnose(mine, run_dir / f"r{rotation}-{policy}" / "envoy.log", args.max_num_seqs)
            runs += mine
    return runs



def by_group(backends: int) -> Callable[[Request], int]:
    """The affinity reference's route: prefix group g goes to backend g mod M."""

    def route(request: Request) -> int:
        assert request.group is not None  # every `shared` request has its group
        return request.group % backends

    return route


def run_affinity(args: argparse.Namespace, workload: Workload, run_dir: Path) -> list[Run]:
    """`shared` with each group pinned to one backend by the client, straight to the simulators."""
    runs = []
    for rotation in range(args.rotations):
        sup = Supervisor(run_dir / f"affinity-{rotation}")
        sup.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            sims = start_sims(sup, args.backends, sim_args(args))
            urls = [s.url for s in sims]
            for u in urls:
                warm(f"{u}/v1", None)
            wait_idle(urls, 0.2)
            run = measure("affinity (reference)", rotation, sup, urls, [f"{u}/v1" for u in urls], None, workload,
                          args.speed, route=by_group(len(urls)))
            runs.append(run)
            print("  " + one_line(run), flush=True)
        finally:
            sup.stop_all(timeout=5)
    return runs



def one_line(run: Run) -> str:
    ttfts = [v for t in run.timed if (v := t.ttft) is not None]
    errors = sum(1 for t in run.timed if not t.record.completed)
    p95 = nearest_rank(ttfts, 95) * 1000 if ttfts else float("nan")
    cpu = sum(run.cpu_s.values()) / run.wall_s * 100 if run.wall_s else 0
    return (f"{run.workload:7s} {len(run.timed)} requests, {errors} errors, TTFT p95 {p95:.0f} ms, "
            f"wall {run.wall_s:.1f} s, CPU {cpu:.0f}% of one core, load {run.load1:.1f}, per backend {run.received}")

