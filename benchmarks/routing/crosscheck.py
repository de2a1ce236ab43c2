"""The cross-check runs: an idle baseline, then workloads whose requests are split between this
benchmark's driver (even) and the independent `openai`-SDK client in its own process (odd), with the
simulators' TTFT/E2E histograms scraped before and after each run."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.routing import envoy_log
from benchmarks.routing.driver import Timed, drive
from benchmarks.routing.promhist import Histogram, parse_histogram
from benchmarks.routing.stacks import MODEL, get_text, sim_args, wait_idle, warm, with_policy
from benchmarks.routing.workloads import Request, Workload
from modeldock.devstack.stack import API_KEY, Stack, running_stack

TTFT = "vllm:time_to_first_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"


@dataclass
class Cross:
    """One workload sent once, split between the bench driver (even) and the SDK client (odd)."""

    workload: str
    requests: int
    bench: list[Timed]
    sdk: list[dict[str, Any]]
    ttft: Histogram  # simulators' histograms over exactly this run's requests, summed over backends
    e2e: Histogram
    bench_cpu_s: float
    sdk_cpu_s: float
    wall_s: float
    load1: float
    bench_s_per_chunk: float  # client CPU per stream chunk, request handling included
    sdk_s_per_chunk: float
    window: tuple[float, float] = (0.0, 0.0)  # unix time
    envoy_ttfb: list[float] = field(default_factory=list)  # Envoy: request in -> upstream's response headers



@dataclass
class Probe:
    """Sequential requests at idle, straight to one simulator and through the gateway."""

    direct: list[Timed]
    gateway: list[Timed]
    sdk: list[dict[str, Any]]  # the same requests through the gateway, timed by the SDK client
    sim_ttft_mean: float | None
    window: tuple[float, float] = (0.0, 0.0)  # unix time
    envoy_ttfb: list[float] = field(default_factory=list)



def scrape_hists(urls: Sequence[str]) -> tuple[Histogram, Histogram]:
    pages = [get_text(f"{u}/metrics") for u in urls]
    return _sum(parse_histogram(p, TTFT) for p in pages), _sum(parse_histogram(p, E2E) for p in pages)



def idle_probe(stack: Stack, count: int = 20) -> Probe:
    reqs = [Request(i, i * 0.05, "probe", ({"role": "user", "content": f"probe {i}"},), 2, 3) for i in range(count)]
    urls = [s.url for s in stack.sims]
    before, _ = scrape_hists(urls)
    begin = time.time()
    direct: list[Timed] = []
    gateway: list[Timed] = []
    for _ in range(2):  # alternate, so drift hits both alike
        direct += asyncio.run(drive(f"{stack.sims[0].url}/v1", MODEL, None, reqs, 1.0)).timed
        gateway += asyncio.run(drive(stack.base_url, MODEL, API_KEY, reqs, 1.0)).timed
    after, _ = scrape_hists(urls)
    sdk = run_sdk(stack.base_url, reqs, 1.0, stack.run_dir / "sdk-probe")
    return Probe(direct, gateway, sdk, (after - before).mean, (begin, time.time()))



def sdk_plan(url: str, requests: Sequence[Request], speed: float, start_unix: float) -> dict[str, Any]:
    return {"url": url, "model": MODEL, "token": API_KEY, "start_unix": start_unix, "speed": speed, "timeout": 120.0,
            "requests": [{"index": r.index, "at": r.at, "messages": list(r.messages), "max_tokens": r.max_tokens}
                         for r in requests]}



def start_sdk(url: str, requests: Sequence[Request], speed: float, stem: Path, start_unix: float
              ) -> tuple[subprocess.Popen[bytes], Path]:
    plan_path, out_path = stem.with_suffix(".plan.json"), stem.with_suffix(".out.json")
    plan_path.write_text(json.dumps(sdk_plan(url, requests, speed, start_unix)))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("openai_client.py")),
                             str(plan_path), str(out_path)])
    return proc, out_path



def finish_sdk(proc: subprocess.Popen[bytes], out_path: Path) -> tuple[list[dict[str, Any]], float, float, int]:
    """Wait for the SDK process: its results, CPU seconds in all, CPU seconds after its imports, chunks read."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"openai client exited with {proc.returncode}")
    out = json.loads(out_path.read_text())
    return out["results"], usage.ru_utime + usage.ru_stime, out["cpu_s"], out["chunks"]



def run_sdk(url: str, requests: Sequence[Request], speed: float, stem: Path) -> list[dict[str, Any]]:
    proc, out = start_sdk(url, requests, speed, stem, time.time() + 3.0)
    return finish_sdk(proc, out)[0]



def cross_one(args: argparse.Namespace, stack: Stack, workload: Workload, run_dir: Path) -> Cross:
    """Every request of `workload` (warm-up ones included, so the clients and the simulators'
    histograms count the same population), even ones by the bench driver, odd ones by the SDK."""
    print(f"cross-check: default / {workload.name}, bench driver + openai SDK client", flush=True)
    urls = [s.url for s in stack.sims]
    bench_part = [r for r in workload.requests if r.index % 2 == 0]
    sdk_part = [r for r in workload.requests if r.index % 2 == 1]
    before_ttft, before_e2e = scrape_hists(urls)
    begin = time.time()
    start_unix = time.time() + 3.0  # the SDK process needs a moment to import openai
    proc, out_path = start_sdk(stack.base_url, sdk_part, args.speed, run_dir / f"sdk-{workload.name}", start_unix)
    start = time.perf_counter() + (start_unix - time.time())
    cpu0 = time.process_time()
    result = asyncio.run(drive(stack.base_url, MODEL, API_KEY, bench_part, args.speed, start_at=start))
    bench_cpu = time.process_time() - cpu0
    sdk, sdk_cpu, sdk_work_cpu, sdk_chunks = finish_sdk(proc, out_path)
    wait_idle(urls, 0.0)
    after_ttft, after_e2e = scrape_hists(urls)
    wall = max((t.done_at for t in result.timed), default=start) - start
    # The bench driver's chunks: one per token, the role chunk, the usage chunk and [DONE].
    bench_chunks = sum((t.record.completion_tokens or 0) + 3 for t in result.timed)
    return Cross(workload.name, len(workload.requests), result.timed, sdk, after_ttft - before_ttft,
                 after_e2e - before_e2e, bench_cpu, sdk_cpu, wall, os.getloadavg()[0],
                 bench_cpu / max(1, bench_chunks), sdk_work_cpu / max(1, sdk_chunks), (begin, time.time()))



def run_cross_checks(args: argparse.Namespace, workloads: Sequence[Workload], run_dir: Path
                     ) -> tuple[Probe, list[Cross]]:
    with running_stack(run_dir / "cross-check", backends=args.backends, sim_args=sim_args(args),
                       edit_config=with_policy("default"), log_level="warning") as stack:
        urls = [s.url for s in stack.sims]
        warm(stack.base_url, API_KEY)
        wait_idle(urls, args.settle)
        probe = idle_probe(stack)
        out = []
        for workload in workloads:
            wait_idle(urls, args.settle)
            out.append(cross_one(args, stack, workload, run_dir))
    # The way in, as Envoy logged it (read after the stack stopped, so the log is flushed).
    log = run_dir / "cross-check" / "envoy.log"
    if log.exists():
        entries = envoy_log.parse(log)
        items: list[Probe | Cross] = [probe, *out]
        for item in items:
            item.envoy_ttfb = [e.ttfb for e in envoy_log.within(entries, *item.window) if e.ttfb is not None]
    return probe, out



def _sum(hists: Iterable[Histogram]) -> Histogram:
    items = list(hists)
    total = items[0]
    for h in items[1:]:
        total = total + h
    return total

