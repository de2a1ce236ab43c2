"""Routing quality of the picking policies, side by side in one run, behind the real gateway.

For each policy (round_robin, least_request, seed, default) a fresh stack is started with
`tests.support.stack.running_stack` (M simulated vLLM backends + xDS + ext_proc + Envoy, the policy
set in `routing.policy`), and the same seeded workloads are sent open-loop through Envoy. The whole
rotation runs twice, the second time in reverse order, so slow drift of the shared machine hits
every policy alike. Then:

- a reference run of `shared` with client-side group affinity straight to the backends (no
  gateway), the best a prefix-aware policy could do;
- a cross-check run (policy `default`; an idle baseline, then `bursts` and `mixed`): even-numbered
  requests are timed by this benchmark's driver, odd-numbered ones by an independent `openai`-SDK
  client in its own process, on the same schedule, and both are compared with the simulators' own
  Prometheus histograms.

Writes the `routing` and `cross-check` sections of docs/benchmarks.md and docs/routing.png.

    .venv/bin/python benchmarks/routing/run.py              # ~7.5 minutes on 2 cores
    .venv/bin/python benchmarks/routing/run.py --quick      # a smoke run, ~3 minutes, writes nothing
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._proc import cpu_seconds  # noqa: E402
from benchmarks._report import table, write_section  # noqa: E402
from benchmarks.routing import envoy_log  # noqa: E402
from benchmarks.routing.driver import DriveResult, Timed, drive  # noqa: E402
from benchmarks.routing.promhist import Histogram, from_values, parse_histogram  # noqa: E402
from benchmarks.routing.workloads import WORKLOADS, Request, Workload  # noqa: E402
from modeldock.bench.stats import nearest_rank  # noqa: E402
from modeldock.up import Supervisor  # noqa: E402
from tests.support.stack import API_KEY, Stack, running_stack, start_sims, wait_until  # noqa: E402

POLICIES = ("round_robin", "least_request", "seed", "default")
MODEL = "demo-model"
TTFT = "vllm:time_to_first_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"
DOC_PNG = ROOT / "docs" / "routing.png"
COMMAND = ".venv/bin/python benchmarks/routing/run.py"


# -- measurement plumbing -----------------------------------------------------------------------


def component(name: str) -> str:
    return "sims" if name.startswith("sim-") else name.split("-")[0]


def cpu_by_component(sup: Supervisor) -> dict[str, float]:
    out: dict[str, float] = Counter()
    for child in sup.children:
        out[component(child.name)] += cpu_seconds(child.proc.pid)
    out["client"] = time.process_time()
    return dict(out)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 (loopback)
        return json.loads(resp.read())


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 (loopback)
        return resp.read().decode()


def sim_stats(urls: Sequence[str]) -> list[dict[str, Any]]:
    return [get_json(f"{u}/sim/stats") for u in urls]


def wait_idle(urls: Sequence[str], settle: float) -> None:
    """Every simulator has nothing running or queued; then `settle` seconds so the gateway's
    scraper (every 0.5 s) has seen them idle."""
    wait_until(lambda: all(s["running"] == 0 and s["waiting"] == 0 for s in sim_stats(urls)), 120, 0.1,
               "simulators idle")
    time.sleep(settle)


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


async def _drive(url: str, token: str | None, requests: Sequence[Request], speed: float) -> DriveResult:
    return await drive(url, MODEL, token, requests, speed)


def measure(policy: str, rotation: int, sup: Supervisor, sim_urls: Sequence[str], url: str | Sequence[str],
            token: str | None, workload: Workload, speed: float, route: Any = None) -> Run:
    """Send `workload` to `url`, or, with `route` (request -> index into `url`), each request to
    the URL its route gives (the affinity reference)."""
    before_stats, before_cpu = sim_stats(sim_urls), cpu_by_component(sup)
    begin = time.time() + 0.2 + workload.warmup / speed  # the driver starts 0.2 s after it is called
    if route is None:
        result = asyncio.run(_drive(url, token, workload.requests, speed))
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
            "same_as_previous": (sum(1 for a, b in zip(ups, ups[1:]) if a == b) / (len(ups) - 1)
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


def warm(url: str, token: str | None) -> None:
    """A few tiny requests so connections and scrape samples exist before measuring (their prompts
    share nothing with any workload's, so they leave nothing useful in the prefix cache)."""
    asyncio.run(_drive(url, token, [Request(i, 0.0, "warm", ({"role": "user", "content": f"warm-up {i}"},), 4, 3)
                                    for i in range(8)], 1.0))


# -- the runs --------------------------------------------------------------------------------------

def sim_args(args: argparse.Namespace) -> list[str]:
    return ["--speed", f"{args.speed:g}", "--max-num-seqs", str(args.max_num_seqs),
            "--num-gpu-blocks", str(args.num_gpu_blocks), "--max-model-len", "8192"]


def with_routing(routing: dict[str, Any]) -> Any:
    def edit(data: dict[str, Any], _sims: Any) -> None:
        data["routing"] = routing
    return edit


def with_policy(policy: str) -> Any:
    return with_routing({"policy": policy})


def run_rotations(args: argparse.Namespace, workloads: Sequence[Workload], run_dir: Path) -> list[Run]:
    runs: list[Run] = []
    for rotation in range(args.rotations):
        order = args.lineup if rotation % 2 == 0 else args.lineup[::-1]
        for policy in order:
            print(f"rotation {rotation + 1}: {policy}", flush=True)
            with running_stack(run_dir / f"r{rotation}-{policy}", backends=args.backends, sim_args=sim_args(args),
                               edit_config=with_routing(args.routing[policy]), log_level="warning") as stack:
                urls = [s.url for s in stack.sims]
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
                          args.speed, route=lambda r: r.group % len(urls))
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


# -- cross-check --------------------------------------------------------------------------------

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
        for item in (probe, *out):
            item.envoy_ttfb = [e.ttfb for e in envoy_log.within(entries, *item.window) if e.ttfb is not None]
    return probe, out


def _sum(hists: Iterable[Histogram]) -> Histogram:
    items = list(hists)
    total = items[0]
    for h in items[1:]:
        total = total + h
    return total


# -- report -------------------------------------------------------------------------------------

def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}" if value >= 0.1 else f"{value * 1000:.1f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def values(timed: Iterable[Timed], what: str) -> list[float]:
    return [v for t in timed if (v := getattr(t, what)) is not None]


def errors_text(timed: Sequence[Timed]) -> str:
    kinds = Counter(t.record.error for t in timed if not t.record.completed)
    return ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items())) or "0"


@dataclass
class Cell:
    """One (policy, workload) pooled over rotations."""

    runs: list[Run]

    @property
    def timed(self) -> list[Timed]:
        return [t for r in self.runs for t in r.timed]

    def stat(self, what: str, p: int) -> float | None:
        vals = values(self.timed, what)
        return nearest_rank(vals, p) if vals else None

    def per_rotation_p95(self) -> list[float | None]:
        out = []
        for run in self.runs:
            vals = values(run.timed, "ttft")
            out.append(nearest_rank(vals, 95) if vals else None)
        return out

    @property
    def wall(self) -> float:
        return sum(r.wall_s for r in self.runs)

    def throughput(self) -> tuple[float, float]:
        done = [t for t in self.timed if t.record.completed]
        tokens = sum(t.record.completion_tokens or 0 for t in done)
        return len(done) / self.wall, tokens / self.wall

    def hit_rate(self) -> float | None:
        q = sum(r.prefix_queries for r in self.runs)
        return sum(r.prefix_hits for r in self.runs) / q if q else None

    def imbalance(self) -> float:
        """Busiest backend's share of requests over the mean share, averaged over runs."""
        return statistics.fmean(max(r.received) / statistics.fmean(r.received) for r in self.runs)

    def diag(self, key: str) -> float | None:
        vals = [r.diag[key] for r in self.runs if r.diag.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    def kind_p95(self, kind: str) -> float | None:
        vals = [v for t in self.timed if t.request.kind == kind and (v := t.ttft) is not None]
        return nearest_rank(vals, 95) if vals else None


def cells(runs: Sequence[Run]) -> dict[tuple[str, str], Cell]:
    out: dict[tuple[str, str], Cell] = {}
    for run in runs:
        out.setdefault((run.policy, run.workload), Cell([])).runs.append(run)
    return out


def routing_body(args: argparse.Namespace, workloads: Sequence[Workload], runs: Sequence[Run],
                 affinity: Sequence[Run], plot_name: str | None) -> tuple[str, dict[str, Any]]:
    grid = cells(runs)
    aff = cells(affinity)
    policies = [p for p in args.lineup if any((p, w.name) in grid for w in workloads)]
    rows = []
    for w in workloads:
        keys = [(p, w.name) for p in policies] + list(aff.keys() if w.name == "shared" else [])
        for key in keys:
            cell = grid.get(key) or aff.get(key)
            if cell is None:
                continue
            req_s, tok_s = cell.throughput()
            rot = " / ".join(ms(v) for v in cell.per_rotation_p95())
            hit = cell.hit_rate()
            done = sum(1 for t in cell.timed if t.record.completed)
            rows.append([w.name, key[0], f"{done}/{len(cell.timed)}", ms(cell.stat("ttft", 50)),
                         ms(cell.stat("ttft", 95)), rot, ms(cell.stat("e2e", 95)), f"{req_s:.1f}", f"{tok_s:.0f}",
                         errors_text(cell.timed), f"{cell.imbalance():.2f}",
                         "-" if hit is None else f"{hit:.0%}", sum(r.preemptions for r in cell.runs)])
    main = table(["workload", "policy", "completed", "TTFT p50 ms", "TTFT p95 ms", "TTFT p95 per rotation",
                  "E2E p95 ms", "req/s", "output tok/s", "errors", "busiest backend / mean", "prefix hits",
                  "preemptions"], rows)

    # By request class: who pays for bad routing.
    class_rows = []
    for w in workloads:
        kinds = [k for k in w.kinds() if k != "shared"]
        for k in kinds:
            class_rows.append([w.name, k, *[ms(grid[(p, w.name)].kind_p95(k)) if (p, w.name) in grid else "-"
                                            for p in policies]])
    by_class = table(["workload", "requests", *[f"{p} TTFT p95 ms" for p in policies]], class_rows)

    # Load on the machine.
    load_rows = []
    for w in workloads:
        wruns = [r for r in runs if r.workload == w.name]
        if not wruns:
            continue
        comps = sorted({k for r in wruns for k in r.cpu_s})
        share = {c: statistics.fmean(r.cpu_s.get(c, 0.0) / r.wall_s * 100 for r in wruns) for c in comps}
        total = statistics.fmean(sum(r.cpu_s.values()) / r.wall_s * 100 for r in wruns)
        late = [t.late_s for r in wruns for t in r.timed]
        load_rows.append([w.name, f"{total:.0f}", ", ".join(f"{c} {share[c]:.0f}" for c in comps),
                          f"{max(r.load1 for r in wruns):.1f}", ms(nearest_rank(late, 99)), ms(max(late))])
    load = table(["workload", "our CPU % of one core (mean)", "by process (%)", "max 1-min load avg",
                  "send lag p99 ms", "send lag max ms"], load_rows)

    facts = headline(grid, workloads)
    diag_rows = []
    for w in workloads:
        for p in policies:
            cell = grid.get((p, w.name))
            if cell is None:
                continue
            diag_rows.append([w.name, p, pct(cell.diag("same_as_previous")), pct(cell.diag("over_slots")),
                              num(cell.diag("peak_in_flight"), 0), num(cell.diag("peak_long"), 0),
                              num(cell.diag("burst_max"), 2)])
    diag = table(["workload", "policy", "same backend as the previous request", f"time some backend held > "
                  f"{args.max_num_seqs} requests", "peak requests on one backend", "peak long generations on one "
                  "backend", f"busiest backend's share of a burst of {workloads_param(workloads, 'bursts', 'size')}"],
                 diag_rows)
    why = explanations(args, grid, workloads)
    shared_w = next((w for w in workloads if w.name == "shared"), None)
    if shared_w is not None and any((p, "shared") in grid for p in policies):
        hits = ", ".join(f"`{p}` {pct(grid[(p, 'shared')].hit_rate())}" for p in policies if (p, "shared") in grid)
        ref = next(iter(aff.values()), None)
        ref_text = (f" The reference run that pins each group to one backend (client-side, straight to the "
                    f"simulators, so without the gateway's few ms) reaches {pct(ref.hit_rate())} hits and a TTFT p95 "
                    f"of {ms(ref.stat('ttft', 95))} ms." if ref is not None else "")
        d_sh, rr_sh = grid.get(("default", "shared")), grid.get(("round_robin", "shared"))
        gain = (f" On `shared`, `default` reaches TTFT p95 {ms(d_sh.stat('ttft', 95))} ms against "
                f"{ms(rr_sh.stat('ttft', 95))} ms for `round_robin`."
                if d_sh is not None and rr_sh is not None else "")
        why += f"""

**Prefix caching and `shared`: only `default` is prefix-aware.** It hashes the first blocks of each prompt
and prefers an endpoint that was sent the same beginning recently, within a load bound (`routing.weights.prefix`,
see modeldock/picking/README.md), so a group's requests mostly stay on the backends that hold its
{shared_w.params['prefix_tokens']}-token prefix. The other policies rank by load only and spread each group over
all {args.backends} backends, which then have to hold, or recompute, every group's prefix:
{shared_w.params['groups']} × {shared_w.params['prefix_tokens']:,} = {shared_w.params['groups'] * shared_w.params['prefix_tokens']:,} tokens against
{args.num_gpu_blocks * 16:,} tokens of KV cache per backend, so prefixes keep evicting each other. Prefix hits:
{hits}.{gain}{ref_text}"""
    wl_lines = "\n".join(f"- **{w.name}**: {w.description}; {len(w.requests)} requests over {w.duration:g} "
                         f"simulated s ({w.duration / args.speed:.1f} s wall); parameters `{json.dumps(w.params)}`."
                         for w in workloads)
    plot_md = f"\n![TTFT p50 and p95 per policy and workload]({plot_name})\n" if plot_name else ""
    body = f"""
{args.backends} simulated vLLM backends (`modeldock sim {' '.join(sim_args(args))}`: {args.max_num_seqs} running
sequences at most, a KV cache of {args.num_gpu_blocks} blocks = {args.num_gpu_blocks * 16:,} tokens each, prefix
caching on) behind the real gateway (Envoy + ext_proc + xDS, started by `tests/support/stack.py`), one fresh
stack per policy. Every policy gets exactly the same seeded requests (seed {args.seed}), sent **open-loop**: each
request leaves at its planned time whatever the latency of the others (Poisson arrivals, plus bursts), so a
backend that routing overloads builds a queue and the queue shows in TTFT. A closed loop would slow down
with the server and hide it. The rotation of the policies ran {args.rotations} time(s), every second one in reverse
order so drift of the shared machine hits each policy alike; results are pooled over rotations (the
per-rotation TTFT p95 column shows the noise).

Workloads (arrival times in simulated seconds; the simulator runs {args.speed:g}x faster than real time, so all
latencies below are wall-clock at that speed: multiply by {args.speed:g} for H100-equivalent times, gateway and
client overhead included):

{wl_lines}

Latencies are the `modeldock bench` definitions (TTFT = first non-empty content − send, E2E = `[DONE]` − send,
nearest-rank percentiles over completed requests only). Throughput is completed requests (and output tokens,
from `usage`) over the wall time from the first planned send to the last end; with an open loop it is mostly
the offered rate, so latency is the result that matters. "busiest backend / mean" is the request count of the
most loaded backend over the mean (1.00 is a perfect split by count); prefix hits and preemptions are the
simulators' own counters.
{plot_md}
{main}

Where the requests went, from Envoy's access log (means over rotations; "same backend as the previous
request" would be 0% for a strict rotation and 25% for random picks among 4; a request held on a backend
beyond its {args.max_num_seqs} running slots is queued there):

{diag}

TTFT p95 by request class (who pays for the routing):

{by_class}

{facts}

{why}

Load on the machine while measuring (CPU of our processes from /proc, 2 cores = 200%; other engineers'
jobs share the machine, so the load average includes them). Send lag is how late the open-loop client sent
a request relative to its plan; it stays small when the client is not saturated:

{load}
"""
    return body, {"grid": {f"{p}/{w}": c.stat("ttft", 95) for (p, w), c in grid.items()}}


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def workloads_param(workloads: Sequence[Workload], name: str, key: str) -> Any:
    return next((w.params.get(key) for w in workloads if w.name == name), "-")


def explanations(args: argparse.Namespace, grid: dict[tuple[str, str], Cell], workloads: Sequence[Workload]) -> str:
    """Why `default` did not beat `round_robin`, for each workload where it did not (the analysis of
    this benchmark, with this run's numbers filled in)."""
    out = []
    for w in workloads:
        d, rr = grid.get(("default", w.name)), grid.get(("round_robin", w.name))
        if d is None or rr is None or (d.stat("ttft", 95) or 0) < (rr.stat("ttft", 95) or 0):
            continue
        lr = grid.get(("least_request", w.name))
        d95, rr95 = d.stat("ttft", 95) or 0, rr.stat("ttft", 95) or 0
        if w.name == "bursts" and rr95 and d95 <= rr95 * 1.03:
            out.append(f"""**`default` ties `round_robin` on `bursts`** (TTFT p95 {ms(d95)} vs {ms(rr95)} ms). Both now
spread each burst evenly (busiest backend's share {num(d.diag('burst_max'), 2)} vs {num(rr.diag('burst_max'), 2)} per
burst, ideal {w.params['size'] / args.backends:.2f}): near-equal scores go to the endpoint picked longest ago. What
remains is the prefill of the burst's long prompts, which no placement shortens once each backend has its two. A
prompt-size signal (estimated prompt tokens picked since each endpoint's last sample, as a scorer) was tried and
left out: in quick runs of this workload, TTFT p95 was 159-160 ms at weights 0, 0.2 and 0.4 alike.""")
        elif w.name == "bursts":
            out.append(f"""**Why `default` does not beat `round_robin` on `bursts`.** A burst's {w.params['size']} requests
arrive within {w.params['spread_s'] * 1000 / args.speed:.0f} ms, i.e. as consecutive picks, and `round_robin` sends
consecutive picks to consecutive backends: each backend gets its share of every burst (busiest backend's share
{num(rr.diag('burst_max'), 2)} per burst vs {num(d.diag('burst_max'), 2)} for `default`, ideal
{w.params['size'] / args.backends:.2f}). The burst is over (prefilled) in a few hundred ms, shorter than the
scrape interval (0.5 s), so the metrics-based scores see it late or never; what they see between scrapes is the
in-flight count and the `+1 waiting per pick` correction, which count a 4,096-token prompt like a 64-token chat
turn. A burst request that lands on a backend already prefilling another waits for it: burst requests' TTFT
p95 is {ms(rr.kind_p95('burst'))} ms with `round_robin` and {ms(d.kind_p95('burst'))} ms with `default` (background
requests: {ms(rr.kind_p95('background'))} vs {ms(d.kind_p95('background'))} ms).
A prompt-size-aware load signal (in-flight prefill tokens rather than in-flight requests) would fix this.""")
        elif w.name == "shared":
            lr_same = pct(lr.diag("same_as_previous")) if lr else "-"
            lr_p95 = ms(lr.stat("ttft", 95)) if lr else "-"
            out.append(f"""**Why `default` does not beat `round_robin` on `shared`.** Every request here costs about the
same (a {w.params['prefix_tokens']}-token prefix, cached or not, a short question, {w.params['max_tokens']}
tokens out), and most of that cost comes first, as prefill. A split that is perfect by count is then also
perfect by work, and `round_robin` spaces the requests out in time too: it never sends two consecutive requests
to the same backend, so each backend gets every {args.backends}th arrival. The load-aware policies cannot tell a
backend that has just taken a request (and is still prefilling it) from one about to finish: both show one
request in flight, and the scraped queue/KV samples are up to 0.5 s old while a request lasts ~0.1-0.3 s. With
several backends at equal scores they pick at random or follow the last scrape, so they often put a new
request right behind one that is still prefilling: `default` sent {pct(d.diag('same_as_previous'))} of requests
to the same backend as the request before (`least_request` {lr_same}; random would be 25%), and its sample
terms add stickiness (one pick moves its score by only ~0.1: the queue correction 0.4 × 1/5 plus the in-flight
term 0.15 × 1/9, less than a 0.3-weighted difference in a stale KV reading). Two cache misses on one backend
prefill one after the other, which shows in TTFT p50 ({ms(d.stat('ttft', 50))} vs {ms(rr.stat('ttft', 50))} ms)
and p95 (`least_request` {lr_p95} ms). Prefix hits are about the same ({pct(d.hit_rate())} vs
{pct(rr.hit_rate())}), so the cache is not what separates them (see below). Breaking near-ties by the least
recently picked endpoint, instead of at random, would give the load-aware policies round-robin's spacing when
load cannot tell the endpoints apart.""")
        else:
            out.append(f"**`default` did not beat `round_robin` on `{w.name}`** in this run; see the diagnostics above.")
    return "\n\n".join(out)


def headline(grid: dict[tuple[str, str], Cell], workloads: Sequence[Workload]) -> str:
    lines = []
    for w in workloads:
        d, rr = grid.get(("default", w.name)), grid.get(("round_robin", w.name))
        if d is None or rr is None:
            continue
        dp, rp = d.stat("ttft", 95), rr.stat("ttft", 95)
        verdict = "default is better" if (dp or 0) < (rp or 0) else "default is not better"
        lines.append(f"- **{w.name}**: round_robin TTFT p95 {ms(rp)} ms, default {ms(dp)} ms: "
                     f"round_robin / default = **{ratio(rp, dp)}** ({verdict}).")
        if w.name == "mixed" and dp and rp and dp < rp:
            long_share = (w.params["long_fraction"] * w.params["long_tokens"]) / (
                w.params["long_fraction"] * w.params["long_tokens"]
                + (1 - w.params["long_fraction"]) * w.params["short_tokens"])
            lines.append(f"""
  Why: `round_robin` splits requests evenly by count, but {w.params['long_fraction']:.0%} of the requests carry
  {long_share:.0%} of the output tokens. When long generations pile up on one backend beyond its running slots
  (peak {num(rr.diag('peak_long'), 0)} long generations on one backend vs {num(d.diag('peak_long'), 0)} with
  `default`; some backend held more requests than slots {pct(rr.diag('over_slots'))} of the time vs
  {pct(d.diag('over_slots'))}), every request queued there waits for a long generation to finish, seconds
  rather than milliseconds. `default` (like `least_request`) counts what each backend already holds and steers
  new requests away. The ratio is large because that queueing wait is a whole long generation; it depends on
  load and on the long fraction, and shrinks towards 1 at low load, where nothing queues anyway.""")
    return "Default vs round_robin (TTFT p95, pooled):\n\n" + "\n".join(lines)


def plot(runs: Sequence[Run], affinity: Sequence[Run], workloads: Sequence[Workload], lineup: Sequence[str],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    grid, aff = cells(runs), cells(affinity)
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.8), squeeze=False)
    axes = axes[0]
    for ax, w in zip(axes, workloads, strict=True):
        keys = [(p, w.name) for p in lineup if (p, w.name) in grid]
        if w.name == "shared":
            keys += list(aff.keys())
        names = [k[0].replace(" (reference)", "\n(reference)").replace("_", "\n") for k in keys]
        cellz = [grid.get(k) or aff[k] for k in keys]
        p50 = [(c.stat("ttft", 50) or math.nan) * 1000 for c in cellz]
        p95 = [(c.stat("ttft", 95) or math.nan) * 1000 for c in cellz]
        x = range(len(keys))
        ax.bar([i - 0.2 for i in x], p50, 0.4, label="TTFT p50", color="#9ecae1")
        ax.bar([i + 0.2 for i in x], p95, 0.4, label="TTFT p95", color="#3182bd")
        for i, v in enumerate(p95):
            ax.text(i + 0.2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), names, fontsize=8)
        ax.set_yscale("log")
        finite = [v for v in p50 if v == v]
        ax.set_ylim(bottom=max(1.0, min(finite) / 4) if finite else 1.0, top=max(v for v in p95 if v == v) * 2)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.set_title(w.name)
        ax.set_ylabel("ms (wall clock, log scale)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8)
    fig.suptitle("Routing policies behind the real gateway: TTFT p50 and p95, lower is better", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bootstrap(vals: Sequence[float], p: int | None, seed: int = 7, rounds: int = 2000) -> tuple[float, float]:
    """A 90% bootstrap interval of the nearest-rank p-th percentile (of the mean when p is None)."""
    rng = random.Random(seed)

    def stat(sample: list[float]) -> float:
        return statistics.fmean(sample) if p is None else nearest_rank(sample, p)

    stats = sorted(stat([rng.choice(vals) for _ in vals]) for _ in range(rounds))
    return stats[int(0.05 * rounds)], stats[int(0.95 * rounds) - 1]


def cross_table(cross: Cross) -> tuple[str, dict[str, Any]]:
    b_ttft, b_e2e = values(cross.bench, "ttft"), values(cross.bench, "e2e")
    s_ok = [r for r in cross.sdk if r["error"] is None]
    s_ttft, s_e2e = [r["ttft"] for r in s_ok], [r["e2e"] for r in s_ok]
    h_ttft, h_e2e = cross.ttft, cross.e2e
    keys = ("TTFT p50", "TTFT p95", "E2E p95", "TTFT mean", "E2E mean")

    def exact(ttft: list[float], e2e: list[float]) -> dict[str, float | None]:
        return dict(zip(keys, (nearest_rank(ttft, 50) if ttft else None, nearest_rank(ttft, 95) if ttft else None,
                               nearest_rank(e2e, 95) if e2e else None, statistics.fmean(ttft) if ttft else None,
                               statistics.fmean(e2e) if e2e else None), strict=True))

    def hist(ttft: Histogram, e2e: Histogram) -> dict[str, float | None]:
        return dict(zip(keys, (ttft.quantile(0.5), ttft.quantile(0.95), e2e.quantile(0.95), ttft.mean, e2e.mean),
                        strict=True))

    bench, sdk, both = exact(b_ttft, b_e2e), exact(s_ttft, s_e2e), exact(b_ttft + s_ttft, b_e2e + s_e2e)
    # Client values put in the simulators' buckets and read back the same way: the interpolation error is
    # then the same on both sides, and what is left is a real difference in time.
    bench_b = hist(from_values(b_ttft, h_ttft.edges), from_values(b_e2e, h_e2e.edges))
    both_b = hist(from_values(b_ttft + s_ttft, h_ttft.edges), from_values(b_e2e + s_e2e, h_e2e.edges))
    sims = hist(h_ttft, h_e2e)
    # The SDK client fell behind the stream (late sends; CPU-bound): its half then times itself, not the server.
    sdk_late = [r["late"] for r in cross.sdk]
    bench_late = [t.late_s for t in cross.bench]
    saturated = nearest_rank(sdk_late, 90) > 0.025  # one request in ten sent 25 ms late or worse
    ci = {"TTFT p50": bootstrap(b_ttft, 50), "TTFT p95": bootstrap(b_ttft, 95), "E2E p95": bootstrap(b_e2e, 95),
          "TTFT mean": bootstrap(b_ttft, None), "E2E mean": bootstrap(b_e2e, None)}
    buckets = {"TTFT p50": h_ttft.bucket_of(0.5), "TTFT p95": h_ttft.bucket_of(0.95), "E2E p95": h_e2e.bucket_of(0.95)}

    def rel(x: float | None, ref: float | None) -> str:
        return "" if x is None or not ref else f" ({(x - ref) / ref:+.0%})"

    rows = [
        ["bench driver (even requests)", len(b_ttft),
         *[ms(bench[k]) + (f" [{ms(ci[k][0])}-{ms(ci[k][1])}]" if k in ci else "") for k in keys]],
        ["openai SDK client (odd requests), vs bench", len(s_ttft), *[ms(sdk[k]) + rel(sdk[k], bench[k]) for k in keys]],
        ["both clients (all requests)", len(b_ttft) + len(s_ttft), *[ms(both[k]) for k in keys]],
        ["both clients, read through the histograms' buckets", len(b_ttft) + len(s_ttft),
         *[ms(both_b[k]) for k in keys]],
        ["bench driver, read through the histograms' buckets", len(b_ttft), *[ms(bench_b[k]) for k in keys]],
        [f"simulators' histograms (all requests), vs {'bench' if saturated else 'both clients'} bucketed",
         f"{h_ttft.count:.0f}",
         *[ms(sims[k]) + (f" in ({ms(buckets[k][0])}, {ms(buckets[k][1])}]" if k in buckets else "")
           + rel(sims[k], (bench_b if saturated else both_b)[k]) for k in keys]],
    ]
    text = table(["source", "requests", *[f"{k} ms" for k in keys]], rows)
    s_err = Counter(r["error"] for r in cross.sdk if r["error"] is not None)
    tokens = sum(t.record.completion_tokens or 0 for t in cross.bench)
    facts = {
        "bench": bench, "sdk": sdk, "both": both, "both_b": both_b, "bench_b": bench_b, "sims": sims, "ci": ci,
        "buckets": buckets,
        "bench_done": f"{len(b_ttft)}/{len(cross.bench)}", "bench_errors": errors_text(cross.bench),
        "sdk_done": f"{len(s_ttft)}/{len(cross.sdk)}",
        "sdk_errors": ", ".join(f"{k}: {n}" for k, n in s_err.items()) or "0",
        "hist_counts": (h_ttft.count, h_e2e.count),
        "bench_cpu": cross.bench_cpu_s / cross.wall_s, "sdk_cpu": cross.sdk_cpu_s / cross.wall_s,
        "bench_late": max(t.late_s for t in cross.bench), "sdk_late": max(r["late"] for r in cross.sdk),
        "sdk_late_p50": statistics.median(sdk_late), "sdk_saturated": saturated,
        "sdk_late_p90": nearest_rank(sdk_late, 90), "bench_late_p90": nearest_rank(bench_late, 90),
        "bench_us_per_chunk": cross.bench_s_per_chunk * 1e6, "sdk_us_per_chunk": cross.sdk_s_per_chunk * 1e6,
        "both_hists": (from_values(b_ttft + s_ttft, h_ttft.edges), from_values(b_e2e + s_e2e, h_e2e.edges)),
        "bench_hists": (from_values(b_ttft, h_ttft.edges), from_values(b_e2e, h_e2e.edges)),
        "chunks_per_s": 2 * tokens / cross.wall_s,
    }
    return text, facts


def cross_gaps(probe_fixed: dict[str, float], f: dict[str, Any]) -> list[str]:
    """Each gap over 10%, with its cause as this run's numbers show it."""
    out = []
    bench, sdk, sims, both_b, both = f["bench"], f["sdk"], f["sims"], f["both_b"], f["both"]
    sdk_saturated = f["sdk_saturated"]
    for k in ("TTFT p50", "TTFT p95", "E2E p95", "TTFT mean", "E2E mean"):
        if sdk[k] is None or not bench[k] or abs(sdk[k] - bench[k]) / bench[k] <= 0.10:
            continue
        diff = (sdk[k] - bench[k]) * 1000
        ci = f["ci"].get(k)
        if sdk[k] < bench[k] and not sdk_saturated:
            why = ("the SDK half measured less, which no client overhead can do: the two halves are different "
                   "requests (the tail is made of the few slowest ones, and each half holds a different subset), "
                   f"so this is sampling noise between the halves; the bench half's 90% bootstrap interval is "
                   f"{ms(ci[0])}-{ms(ci[1])} ms" if ci else "the SDK half measured less, which no client overhead "
                   "can do: sampling noise between two different sets of requests")
        elif sdk_saturated:
            why = (f"the SDK client fell behind: it needs ~{f['sdk_us_per_chunk']:.0f} µs of CPU per chunk "
                   f"(the bench driver ~{f['bench_us_per_chunk']:.0f}), sent one request in ten "
                   f"{ms(f['sdk_late_p90'])} ms late or more (bench: {ms(f['bench_late_p90'])} ms) and read chunks "
                   "late in the same way, so its clock runs behind the stream. This is the client measuring itself, "
                   "which is why a benchmark client must stay light")
        elif ci is not None and ci[0] <= sdk[k] <= ci[1]:
            why = ("inside the bench half's 90% bootstrap interval "
                   f"({ms(ci[0])}-{ms(ci[1])} ms): sampling noise between two different sets of requests"
                   + (" (the halves hold different mixes of long and short requests, and those dominate E2E)"
                      if k.startswith("E2E") else ""))
        else:
            why = (f"the SDK's own cost: at idle its TTFT is {ms(probe_fixed['sdk_minus_bench'])} ms above the bench "
                   "driver's (building and validating the request inside `create()`, after the send timestamp, and "
                   "pydantic-parsing each chunk); under load it needs ~"
                   f"{f['sdk_us_per_chunk']:.0f} µs of CPU per chunk (bench ~{f['bench_us_per_chunk']:.0f}) for all "
                   "its concurrent streams, so its event loop is busy when a first chunk arrives (send lag p90 "
                   f"{ms(f['sdk_late_p90'])} ms vs {ms(f['bench_late_p90'])} ms) and the tail grows most")
        out.append(f"- {k}, SDK vs bench: {diff:+.1f} ms ({(sdk[k] - bench[k]) / bench[k]:+.0%}): {why}.")
    for k in ("TTFT p50", "TTFT p95", "E2E p95", "TTFT mean", "E2E mean"):
        # With a saturated SDK half, its times are the SDK's own; compare with the bench half alone (a random
        # half of the same requests).
        ref_b, ref_x = (f["bench_b"], bench) if sdk_saturated else (both_b, both)
        ref = ref_b[k] if k in f["buckets"] else ref_x[k]
        if sims[k] is None or not ref or abs(sims[k] - ref) / ref <= 0.10:
            continue
        diff = (sims[k] - ref) * 1000
        lo, hi = f["buckets"].get(k, (None, None))
        who = "the bench half" if sdk_saturated else "both clients"
        parts = [f"- {k}, simulators vs {who}: {diff:+.1f} ms ({(sims[k] - ref) / ref:+.0%})"]
        if k.endswith("mean"):
            over = "the bench half (a random half of the same requests)" if sdk_saturated else "the same requests"
            parts.append(f": exact means over {over}, so this is time the simulators do not see: the "
                         f"request's way in (client, Envoy, ext_proc's auth/parse/pick, the simulator's HTTP "
                         f"handling before it stamps `arrival`) and the first chunk's way out; at idle that is "
                         f"{ms(probe_fixed['idle_gap'])} ms" + (
                             ". Under load it grows because every hop waits for CPU on a loaded 2-core machine (four "
                             "event loops plus Envoy): Envoy's log shows the way in at "
                             f"{ms(f['envoy_ttfb'])} ms on average here vs {ms(probe_fixed['idle_ttfb'])} ms at idle; "
                             "the rest is the client's side and the first chunk's way back"
                             if -diff > (probe_fixed["idle_gap"] * 1000 + 1.0) else
                             ", about what is measured here (Envoy's log shows the way in at "
                             f"{ms(f['envoy_ttfb'])} ms on average vs {ms(probe_fixed['idle_ttfb'])} ms at idle)"))
        else:
            mean_key = "TTFT mean" if k.startswith("TTFT") else "E2E mean"
            parts.append(f": both read through the same buckets (the simulators' value lies in {ms(lo)}-{ms(hi)} ms), "
                         f"so what differs is time: the simulators do not see the way in and out (mean gap "
                         f"{ms(ref_x[mean_key] - sims[mean_key])} ms). A shift moves values across bucket edges, and "
                         "inside a bucket interpolation spreads them evenly, so a quantile's gap can be larger or "
                         "smaller than the mean gap")
        out.append("".join(parts) + ".")
    # Interpolation error on its own: exact client quantiles vs the same values read through the buckets.
    ttft_h, e2e_h = f["bench_hists"] if sdk_saturated else f["both_hists"]
    ref_b, ref_x = (f["bench_b"], bench) if sdk_saturated else (both_b, both)
    who = "the bench half's" if sdk_saturated else "the clients'"
    for k, q in (("TTFT p50", 0.5), ("TTFT p95", 0.95), ("E2E p95", 0.95)):
        if ref_x[k] and ref_b[k] and abs(ref_b[k] - ref_x[k]) / ref_x[k] > 0.10:
            lo, hi = (ttft_h if k.startswith("TTFT") else e2e_h).bucket_of(q)
            out.append(f"- {k}, bucket resolution alone: {who} exact {ms(ref_x[k])} ms reads as {ms(ref_b[k])} ms "
                       f"through the histograms' buckets ({(ref_b[k] - ref_x[k]) / ref_x[k]:+.0%}): it falls in the "
                       f"{ms(lo)}-{ms(hi)} ms bucket, and linear interpolation assumes values are spread evenly in it.")
    return out or ["- none: every compared figure is within 10%."]


def cross_section(args: argparse.Namespace, probe: Probe, crosses: Sequence[Cross]) -> str:
    d_ttft, g_ttft = values(probe.direct, "ttft"), values(probe.gateway, "ttft")
    s_ttft = [r["ttft"] for r in probe.sdk if r["ttft"] is not None]
    d_med, g_med, s_med = statistics.median(d_ttft), statistics.median(g_ttft), statistics.median(s_ttft)
    sim_mean = probe.sim_ttft_mean or 0.0
    idle_ttfb = statistics.fmean(probe.envoy_ttfb) if probe.envoy_ttfb else None
    fixed = {"sdk_minus_bench": s_med - g_med, "idle_gap": g_med - sim_mean, "idle_ttfb": idle_ttfb}
    parts = [f"""
Same runs, same load, on one fresh stack with policy `default` ({args.backends} backends, the simulator flags of
the `routing` section). Each workload's requests (warm-up ones included, so all views count the same population)
were split between two clients on one wall-clock schedule: even-numbered ones sent and timed by this
benchmark's driver (`benchmarks/routing/driver.py`: the `modeldock.bench` SSE parser, records and TTFT/E2E
definitions), odd-numbered ones by an independent client in its own process, `benchmarks/routing/openai_client.py`
(the `openai` SDK's async streaming API over httpx; TTFT = first chunk with a non-empty `delta.content` − just
before `create()`, E2E = end of the stream − the same instant). The simulators' `{TTFT}` and `{E2E}`
histograms were scraped before and after each run (difference, summed over backends), so they cover exactly the
run's requests; their quantiles are interpolated linearly inside the bucket (as `histogram_quantile`), their
means are exact (`_sum/_count`). The bench row gives its 90% bootstrap interval in brackets, the sampling noise
of a half.

Why not guidellm: `guidellm` 0.8.1 on PyPI requires `torch`, `transformers` and `datasets`, and its synthetic
data needs a Hugging Face tokenizer (`--processor`) fetched from the hub, which cannot be downloaded here. The
SDK client above is the independent client instead.

**Idle baseline** (20 sequential 2-token requests, twice, alternating straight to a simulator and through the
gateway, then the same 20 through the gateway with the SDK client): the simulators' own TTFT mean is
{ms(sim_mean)} ms (one engine step at this speed). Median TTFT: bench driver straight to a simulator
{ms(d_med)} ms, through the gateway {ms(g_med)} ms, SDK client through the gateway {ms(s_med)} ms. So at idle
the gateway (Envoy + ext_proc: auth, body parse, pick) adds {ms(g_med - d_med)} ms, the bench client plus the
simulator's HTTP handling {ms(d_med - sim_mean)} ms that the simulators' histograms cannot see (they start the
clock when the request is handed to the engine), and the SDK's own request handling {ms(s_med - g_med)} ms more
than the bench driver's. Envoy's access log times the way in: from Envoy receiving a request to the simulator's
response headers, which it sends as soon as the request reaches its engine (`ttfb`, through ext_proc's auth,
body parse and pick); at idle that is {ms(idle_ttfb)} ms on average.
"""]
    for cross in crosses:
        text, f = cross_table(cross)
        f["envoy_ttfb"] = statistics.fmean(cross.envoy_ttfb) if cross.envoy_ttfb else None
        f["envoy_ttfb_p95"] = nearest_rank(cross.envoy_ttfb, 95) if cross.envoy_ttfb else None
        parts.append(f"""
### {cross.workload} ({cross.requests} requests)

{text}

Completed: bench driver {f['bench_done']} (errors: {f['bench_errors']}), SDK client {f['sdk_done']} (errors:
{f['sdk_errors']}); the simulators counted {f['hist_counts'][0]:.0f} first tokens and {f['hist_counts'][1]:.0f}
finished requests. About {f['chunks_per_s']:.0f} SSE chunks/s reached the clients in all. CPU over the run: bench
driver {f['bench_cpu']:.0%} of a core, SDK client process {f['sdk_cpu']:.0%} (its import included), i.e. about
{f['bench_us_per_chunk']:.0f} and {f['sdk_us_per_chunk']:.0f} µs per chunk received (request handling included);
send lag p90 / max {ms(f['bench_late_p90'])} / {ms(f['bench_late'])} ms (bench) and {ms(f['sdk_late_p90'])} /
{ms(f['sdk_late'])} ms (SDK){'; the SDK client counts as saturated (p90 lag over 25 ms), so the simulators are compared with the bench half' if f['sdk_saturated'] else ''}.

Envoy's way in (request received → simulator's response headers) averaged {ms(f['envoy_ttfb'])} ms (p95
{ms(f['envoy_ttfb_p95'])} ms) during this run, against {ms(idle_ttfb)} ms at idle.

Gaps over 10%:

""" + "\n".join(cross_gaps(fixed, f)))
    return "\n".join(parts)


# -- main -------------------------------------------------------------------------------------------

def build_workloads(args: argparse.Namespace) -> list[Workload]:
    k = args.length_scale
    short, long_ = max(1, round(64 * k)), max(1, round(2000 * k))
    scale = args.duration_scale
    built = {
        "mixed": WORKLOADS["mixed"](args.seed, duration=18.0 * scale, rate=args.mixed_rate * 0.5 / k,
                                    warmup=6.0 * k / 0.5,
                                    short_tokens=short, long_tokens=long_),
        "bursts": WORKLOADS["bursts"](args.seed, duration=15.0 * scale),
        "shared": WORKLOADS["shared"](args.seed, duration=12.0 * scale),
    }
    return [built[name] for name in args.workloads]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", type=int, default=4)
    parser.add_argument("--speed", type=float, default=1.5, help="simulator time factor (default %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--num-gpu-blocks", type=int, default=768)
    parser.add_argument("--rotations", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--settle", type=float, default=1.2, help="idle seconds before each workload")
    parser.add_argument("--length-scale", type=float, default=0.5,
                        help="mixed: output lengths are 64 and 2000 tokens times this (default %(default)s)")
    parser.add_argument("--mixed-rate", type=float, default=14.0,
                        help="mixed: arrivals per simulated second at length scale 0.5 (scaled with it)")
    parser.add_argument("--duration-scale", type=float, default=1.0)
    parser.add_argument("--workloads", default="mixed,bursts,shared")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help='an extra contender: a routing config, e.g. tuned=\'{"policy": "default", '
                             '"weights": {"kv": 0, "in_flight": 0.45}}\'')
    parser.add_argument("--no-cross-check", action="store_true")
    parser.add_argument("--cross-check", default="bursts,mixed", help="workloads of the cross-check run")
    parser.add_argument("--no-affinity", action="store_true")
    parser.add_argument("--quick", action="store_true", help="one rotation, short workloads; writes no docs")
    parser.add_argument("--no-write", action="store_true", help="print the sections instead of writing docs")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep logs and raw results here")
    parser.add_argument("--report-from", type=Path, default=None, metavar="RUN_DIR",
                        help="run nothing: rewrite the report from RUN_DIR/raw.pickle of an earlier run")
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    args.policies = tuple(args.policies.split(","))
    args.routing = {p: {"policy": p} for p in args.policies}
    for item in args.variant:
        name, _, spec = item.partition("=")
        args.routing[name] = json.loads(spec)
    args.lineup = tuple(args.routing)
    args.cross_check = args.cross_check.split(",")
    if args.quick:
        args.rotations, args.duration_scale, args.no_write = 1, 0.4, True

    if args.report_from is not None:
        # Only the report, from a finished run's raw results (with this file's current report code).
        with open(args.report_from / "raw.pickle", "rb") as handle:
            saved = pickle.load(handle)  # noqa: S301 (our own file)
        no_write, run_dir = args.no_write, args.report_from
        args = saved["args"]
        args.no_write = no_write
        workloads, runs, affinity = build_workloads(args), saved["runs"], saved["affinity"]
        probe, crosses, elapsed = saved["probe"], saved["crosses"], saved["elapsed"]
    else:
        run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="modeldock-routing-"))
        run_dir.mkdir(parents=True, exist_ok=True)
        workloads = build_workloads(args)
        started = time.monotonic()
        runs = run_rotations(args, workloads, run_dir)
        shared = next((w for w in workloads if w.name == "shared"), None)
        affinity = run_affinity(args, shared, run_dir) if shared is not None and not args.no_affinity else []
        by_name = {w.name: w for w in workloads}
        cross_workloads = [by_name[n] for n in args.cross_check if n in by_name]
        probe, crosses = (run_cross_checks(args, cross_workloads, run_dir)
                          if cross_workloads and not args.no_cross_check else (None, []))
        elapsed = time.monotonic() - started
        with open(run_dir / "raw.pickle", "wb") as handle:
            pickle.dump({"args": args, "runs": runs, "affinity": affinity, "probe": probe, "crosses": crosses,
                         "elapsed": elapsed}, handle)
        dump(run_dir, runs + affinity, crosses)

    png = run_dir / "routing.png" if args.no_write else DOC_PNG
    plot(runs, affinity, workloads, args.lineup, png)
    body, summary = routing_body(args, workloads, runs, affinity, "routing.png")
    body += f"\nTotal wall time of the benchmark: {elapsed / 60:.1f} min. Raw results: `--run-dir` (JSON per run).\n"
    cross_text = cross_section(args, probe, crosses) if probe is not None else None
    if args.no_write:
        print(body)
        if cross_text:
            print(cross_text)
        print(f"plot: {png}; run dir: {run_dir}")
    else:
        write_section("routing", "Routing policies side by side (real gateway, simulated backends)", COMMAND, body)
        if cross_text:
            write_section("cross-check", "Cross-check of the benchmark client", COMMAND, cross_text)
        print(f"wrote docs/benchmarks.md and {png}; run dir: {run_dir}")
    print(json.dumps(summary))
    return 0


def dump(run_dir: Path, runs: Sequence[Run], crosses: Sequence[Cross]) -> None:
    def timed(t: Timed) -> dict[str, Any]:
        return {"index": t.request.index, "kind": t.request.kind, "group": t.request.group, "ttft": t.ttft,
                "e2e": t.e2e, "error": t.record.error, "late": t.late_s, "tokens": t.record.completion_tokens}

    data = [{"policy": r.policy, "rotation": r.rotation, "workload": r.workload, "wall_s": r.wall_s,
             "cpu_s": r.cpu_s, "load1": r.load1, "received": r.received, "preemptions": r.preemptions,
             "prefix_queries": r.prefix_queries, "prefix_hits": r.prefix_hits, "window": r.window, "diag": r.diag,
             "requests": [timed(t) for t in r.timed]} for r in runs]
    (run_dir / "runs.json").write_text(json.dumps(data))
    (run_dir / "cross.json").write_text(json.dumps([
        {"workload": c.workload, "bench": [timed(t) for t in c.bench], "sdk": c.sdk,
         "ttft_hist": c.ttft.__dict__, "e2e_hist": c.e2e.__dict__} for c in crosses]))


if __name__ == "__main__":
    raise SystemExit(main())
