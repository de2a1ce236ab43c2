"""The overload benchmark's harness: the stacks a run drives (`Ctx`), one open-loop phase through the
replicas (`phase`), and the closed-loop capacity run. benchmarks/overload/run.py holds the scenarios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import aiohttp

from benchmarks._proc import cpu_seconds
from benchmarks.overload import phases, plan
from benchmarks.overload.phases import Event, Plan, Sampler, Sent
from benchmarks.overload.plan import Capacity, Mix, Outcome
from benchmarks.routing.driver import Timed
from benchmarks.routing.workloads import Request
from modeldock.bench.metrics import RequestRecord, StreamObserver, ttft
from modeldock.bench.runner import stream_request
from modeldock.bench.stats import nearest_rank
from modeldock.devstack.redis_server import RedisServer
from modeldock.devstack.stack import Replicas, Sim, Stack, wait_until

PREEMPTIONS = "vllm:num_preemptions_total"
TENANT = {t.id: t for t in plan.TENANTS}


@dataclass
class Ctx:
    args: argparse.Namespace
    reps: Replicas
    capacity: Capacity
    mix: Mix
    redis: RedisServer | None = None  # the shared Redis, when this run's configs use one
    live: list[bool] = field(default_factory=list)  # False: that replica was killed

    def __post_init__(self) -> None:
        self.live = self.live or [True] * len(self.reps.stacks)

    @property
    def stacks(self) -> list[Stack]:
        """The replicas still running."""
        return [s for s, up in zip(self.reps.stacks, self.live, strict=True) if up]


# -- plumbing ---------------------------------------------------------------------------------


def sim_args(args: argparse.Namespace) -> list[str]:
    return ["--speed", f"{args.speed:g}", "--max-num-seqs", str(args.max_num_seqs),
            "--num-gpu-blocks", str(args.num_gpu_blocks),
            "--max-model-len", str(min(4096, args.num_gpu_blocks * 16))]


def wait_idle(sims: Sequence[Sim], settle: float) -> None:
    """Nothing running or waiting on any simulator; then `settle` s so the scrapers saw it idle."""
    wait_until(lambda: all(s.stats()["running"] == 0 and s.stats()["waiting"] == 0 for s in sims),
               180, 0.1, "simulators idle")
    time.sleep(settle)


def preemptions(sims: Sequence[Sim]) -> float:
    return sum(phases.gauge(s.port, PREEMPTIONS) or 0.0 for s in sims)


def extproc_cpu(stacks: Sequence[Stack]) -> float:
    return sum(cpu_seconds(c.proc.pid) for st in stacks for c in st.sup.children if c.name.startswith("extproc"))


def outcome(tenant: str, t: Timed) -> Outcome:
    return Outcome(tenant, t.record.error, t.ttft, t.e2e, t.record.detail, t.request.kind)


def phase(ctx: Ctx, name: str, plans: Sequence[Plan], idle_s: float = 0.0, events: Sequence[Event] = (),
          sampler: Sampler | None = None) -> tuple[dict[str, Any], float, list[Sent]]:
    """Send the tenants' schedules open-loop, together, through the replicas their routes name; what
    came of every request, plus the simulators' preemptions and the ext_procs' CPU over the phase.
    With `idle_s`, the ext_procs' CPU is first read over that many idle seconds (their scraping and
    xDS work), to subtract per second. `events` run at their offsets, `sampler` reads while it runs.
    Returns the result, the schedule's start (perf_counter) and every request sent."""
    sims = ctx.reps.sims
    wait_idle(sims, ctx.args.settle)
    idle_rate = None
    if idle_s > 0:
        before = extproc_cpu(ctx.stacks)
        time.sleep(idle_s)
        idle_rate = (extproc_cpu(ctx.stacks) - before) / idle_s
    urls = [s.base_url for s in ctx.reps.stacks]
    pre, began = preemptions(sims), time.monotonic()
    cpu = {id(s): extproc_cpu([s]) for s in ctx.stacks}
    with sampler or contextlib.nullcontext():
        start, sent = asyncio.run(phases.open_loop(urls, ctx.live, plans, ctx.args.timeout, events))
    wall = time.monotonic() - began
    # The CPU of the replicas alive at the end (a killed one's /proc is gone).
    pre, cpu_s = preemptions(sims) - pre, sum(extproc_cpu([s]) - cpu[id(s)] for s in ctx.stacks)
    outcomes = [outcome(s.tenant, s.timed) for s in sent]
    result: dict[str, Any] = {
        "name": name, "wall_s": wall, "preemptions": pre, "extproc_cpu_s": cpu_s,
        "extproc_idle_cpu_per_s": idle_rate,
        "late_p99_s": nearest_rank([s.timed.late_s for s in sent], 99) if sent else None,
        "load1": os.getloadavg()[0], "replicas": len(ctx.stacks),
        "all": plan.aggregate(outcomes), "tenants": plan.by_tenant(outcomes),
        "classes": plan.by_class(outcomes),
        "tenant_classes": {t: plan.by_class([o for o in outcomes if o.tenant == t])
                           for t in sorted({o.tenant for o in outcomes})},
        # Every request (tenant, planned offset s, TTFT s, E2E s, error, class, replica), for reading a tail.
        "requests": [(s.tenant, round(s.timed.request.at, 4), s.timed.ttft, s.timed.e2e, s.timed.record.error,
                      s.timed.request.kind, s.replica) for s in sent],
        "ttft_p95_ci": {t: plan.bootstrap_p95([o.ttft for o in outcomes if o.tenant == t and o.ttft is not None])
                        for t in {o.tenant for o in outcomes}},
    }
    a = result["all"]
    print(f"    {name}: {a['offered']} offered, {a['served_pct']:.0f}% served, {a['r429']} x 429, "
          f"other {a['other_errors']}, TTFT p95 {ms(a['ttft_p95'])} ms, preemptions {pre:.0f}, "
          f"wall {wall:.1f} s, load {result['load1']:.1f}", flush=True)
    return result, start, sent


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


# -- capacity ---------------------------------------------------------------------------------


async def _closed_loop(url: str, key: str, requests: Sequence[Request], concurrency: int, duration: float,
                       timeout: float) -> tuple[float, list[RequestRecord]]:
    """`concurrency` workers, each sending its next request when the last one ended, until
    `duration` s have passed. Returns the start (perf_counter) and every record."""
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream", "Accept-Encoding": "identity",
               "Authorization": f"Bearer {key}"}
    endpoint = url.rstrip("/") + "/chat/completions"
    pending = iter(requests)
    records: list[RequestRecord] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = perf_counter()

        async def worker() -> None:
            for r in pending:
                if perf_counter() - t0 >= duration:
                    return
                record = RequestRecord(index=r.index, sent_at=perf_counter())
                observer = StreamObserver(record, "chat", use_usage=True)
                await stream_request(session, endpoint, headers, json.dumps(r.body(plan.MODEL)).encode(), observer,
                                     timeout)
                records.append(record)
            raise RuntimeError("the closed loop ran out of requests; generate more")

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return t0, records


def measure_capacity(args: argparse.Namespace, stack: Stack, mix: Mix) -> Capacity:
    """Completions per second with every running slot of the pool kept busy: a closed loop at
    concurrency = backends x max_num_seqs through one replica, the first `cap_warmup` seconds not counted."""
    wait_idle(stack.sims, args.settle)
    concurrency = args.backends * args.max_num_seqs
    requests = plan.closed_loop_requests(args.seed, int(args.cap_duration * 80) + 200, mix)
    t0, records = asyncio.run(_closed_loop(stack.base_url, TENANT["main"].key, requests, concurrency,
                                           args.cap_duration, args.timeout))
    ends = [r.ended_at if r.completed and r.ended_at is not None else float("-inf") for r in records]
    cap = plan.capacity(ends, [ttft(r) for r in records], t0, args.cap_warmup, args.cap_duration, concurrency)
    errors = sum(1 for r in records if not r.completed)
    print(f"  capacity: {cap.rate:.2f} req/s ({cap.completed} completions in {cap.window_s:.0f} s at concurrency "
          f"{concurrency}, {errors} errors, TTFT p95 {ms(cap.ttft_p95)} ms)", flush=True)
    return cap
