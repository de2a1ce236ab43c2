"""How long an EndpointSlice change takes to reach Envoy, which part is discovery, and what it costs.

A FakeKubeServer (tests/support/fake_kube.py) runs in this process, or with `--api-process` in its own;
the xDS server runs as its own process watching it through a kubeconfig (a small wrapper, benchmarks/_xds_rig.py,
that also prints when its SnapshotStore and its ResourceCache change); a real Envoy takes CDS and EDS
from it over ADS. Each shape is `MxE[@Nns]`: M models (one Service each) of E endpoints, the Services
spread over N namespaces (discovery holds one watch per namespace). For each change, one endpoint of
one model's EndpointSlice is replaced, and four wall-clock times are taken (one system clock):

    t0  the slice is applied to the fake API server
    t1  the xDS server's SnapshotStore has the new endpoints  (discovery)
    t2  its ResourceCache has the new ResourceSet              (rebuild)
    t3  Envoy applied the EDS update: the cluster's `update_time` stat (ms),
        read once its `membership_change` counter has moved    (push + apply)

Per shape also: the initial sync (xDS start -> serving, Envoy start -> CDS and the last cluster's EDS
applied), the xDS process's TCP connections to the fake API server (/proc/<pid>/fd + /proc/net/tcp)
and the fake's open watches, its RSS and threads after sync and at the end, and the CPU each process
used while the changes ran. The largest shape is run again with the fake in its own process
(`--api-compare`), to show which side limits discovery.

    .venv/bin/python -m benchmarks.xds_latency             # writes the xds-latency section of docs/benchmarks.md
    .venv/bin/python -m benchmarks.xds_latency --no-write --changes 10 --shapes 10x10,100x10@5ns
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks._proc import cpu_seconds, status, tcp_connections
from benchmarks._report import table, write_section
from benchmarks._xds_rig import ChildLog, InlineApi, ProcessApi, child, stop
from modeldock.bench.stats import nearest_rank
from modeldock.envoy import BootstrapOptions, envoy_binary, render_bootstrap
from modeldock.up import free_port

NAMESPACE, PORT_NAME, PORT = "llm", "http", 8000
COMMAND = ".venv/bin/python -m benchmarks.xds_latency"
DEFAULT_SHAPES = "10x10,100x100,300x10,1000x10,100x100@10ns"
ROOT = Path(__file__).resolve().parent.parent
MEMBERSHIP = r"^cluster[.]model_m[0-9]+[.]membership_change$"
ATTEMPTS = r"^cluster[.]model_m[0-9]+[.]update_attempt$"
# ---- the run -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    models: int
    per_model: int
    namespaces: int = 1

    def namespace(self, model: int) -> str:
        return NAMESPACE if self.namespaces == 1 else f"{NAMESPACE}-{model % self.namespaces}"


def parse_shapes(text: str) -> list[Shape]:
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)x(\d+)(?:@(\d+)ns)?", part)
        if not match:
            raise argparse.ArgumentTypeError(f"bad shape {part!r}: MODELSxENDPOINTS[@Nns]")
        shapes.append(Shape(int(match[1]), int(match[2]), int(match[3] or 1)))
    return shapes


def label(models: int, per_model: int, namespaces: int = 1, api_process: bool = False) -> str:
    return (f"{models} x {per_model}" + (f" @{namespaces}ns" if namespaces > 1 else "")
            + (" (API process)" if api_process else ""))


def address(model: int, endpoint: int) -> str:
    return f"10.{model // 256 % 256}.{model % 256}.{endpoint + 1}"


def model_slice(shape: Shape, model: int, addresses: list[str]) -> dict[str, object]:
    from tests.support.fake_kube import make_slice

    return make_slice(f"svc-{model:04d}-a", shape.namespace(model), f"svc-{model:04d}",
                      [(a, True, False) for a in addresses], PORT_NAME, PORT)


def admin_get(admin: str, path: str) -> str:
    with urllib.request.urlopen(f"{admin}{path}", timeout=10) as resp:  # noqa: S310 (loopback)
        return str(resp.read().decode())


def stats(admin: str, pattern: str) -> dict[str, int]:
    text = admin_get(admin, f"/stats?filter={urllib.parse.quote(pattern)}")
    return {name: int(value) for name, value in re.findall(r"^(\S+): (\d+)$", text, re.M)}


def cluster_stats(admin: str, model: int) -> tuple[int, int]:
    """(membership_change, update_time in ms) of the model's cluster."""
    values = stats(admin, f"^cluster[.]model_m{model:04d}[.](membership_change|update_time)$")
    prefix = f"cluster.model_m{model:04d}."
    return values.get(prefix + "membership_change", 0), values.get(prefix + "update_time", 0)


def envoy_synced(admin: str, models: int, per_model: int) -> bool:
    try:
        data = json.loads(admin_get(admin, "/clusters?format=json"))
    except OSError:
        return False
    hosts = {c["name"]: len(c.get("host_statuses", [])) for c in data.get("cluster_statuses", [])}
    return all(hosts.get(f"model:m{i:04d}") == per_model for i in range(models))


@dataclass
class Sample:
    discovery: float  # t1 - t0
    rebuild: float  # t2 - t1
    push: float  # t3 - t2
    total: float  # t3 - t0


@dataclass
class Result:
    shape: Shape
    api_process: bool
    samples: list[Sample] = field(default_factory=list)
    sync: dict[str, float] = field(default_factory=dict)  # seconds: xds ready, CDS, last EDS (from each start)
    cds: dict[str, int] = field(default_factory=dict)  # Envoy's cluster_manager.cds.* counters
    procs: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # "sync"/"end": (conns, watches, rss, threads)
    cpu: dict[str, float] = field(default_factory=dict)  # share of one core while the changes ran
    reads: list[float] = field(default_factory=list)  # seconds per Envoy /stats read in the change loop

    @property
    def label(self) -> str:
        return label(self.shape.models, self.shape.per_model, self.shape.namespaces, self.api_process)


def wait(predicate: object, timeout: float, what: str, proc: list[subprocess.Popen[bytes]],
         every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        for p in proc:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args!r} exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(every)


def run(shape: Shape, changes: int, gap: float, poll: float, api_process: bool) -> Result:
    result = Result(shape, api_process)
    procs: list[subprocess.Popen[bytes]] = []
    api: InlineApi | ProcessApi = ProcessApi() if api_process else InlineApi()
    try:
        with tempfile.TemporaryDirectory(prefix="xds-latency-") as tmp:
            lists = {m: [address(m, e) for e in range(shape.per_model)] for m in range(shape.models)}
            api.op("apply_many", [model_slice(shape, m, addrs) for m, addrs in lists.items()])
            config = Path(tmp) / "config.yaml"
            config.write_text(yaml.safe_dump({"models": [
                {"name": f"m{m:04d}", "kubernetes": {"namespace": shape.namespace(m), "service": f"svc-{m:04d}",
                                                     "port": PORT_NAME}} for m in range(shape.models)]}))
            kubeconfig = api.op("kubeconfig", str(Path(tmp) / "kubeconfig"))
            xds_port, admin_port = free_port(), free_port()
            log = ChildLog()
            xds_start = time.time()
            xds = child([sys.executable, "-m", "benchmarks._xds_rig", "--serve", str(config), kubeconfig,
                         str(xds_port)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
            procs.append(xds)
            threading.Thread(target=log.follow, args=(xds.stdout,), daemon=True).start()
            wait(log.ready, 120, "the xDS server", procs)
            result.sync["xds"] = log.first_after("ready", "-", 0) - xds_start
            bootstrap = Path(tmp) / "envoy.yaml"
            bootstrap.write_text(render_bootstrap(BootstrapOptions(
                listen_port=free_port(), admin_port=admin_port, xds_port=xds_port, extproc_port=free_port())))
            with open(Path(tmp) / "envoy.log", "wb") as envoy_log:
                envoy_start = time.time()
                procs.append(child([envoy_binary(), "-c", str(bootstrap), "--use-dynamic-base-id",
                                    "--concurrency", "1", "--log-level", "warn"],
                                   stdin=subprocess.DEVNULL, stdout=envoy_log, stderr=subprocess.STDOUT))
            admin = f"http://127.0.0.1:{admin_port}"
            wait(lambda: envoy_synced(admin, shape.models, shape.per_model), 120, "Envoy to load every cluster",
                 procs, every=0.2)
            result.sync["synced"] = time.time() - envoy_start
            result.cds = stats(admin, r"^cluster_manager[.](cds[.]update_(success|rejected|failure|time)"
                                      r"|active_clusters|cluster_added)$")
            updated = stats(admin, r"^cluster[.]model_m[0-9]+[.]update_time$")
            result.sync["cds"] = result.cds.get("cluster_manager.cds.update_time", 0) / 1000 - envoy_start
            result.sync["eds"] = max(updated.values(), default=0) / 1000 - envoy_start
            time.sleep(1.0)
            result.procs["sync"] = (tcp_connections(xds.pid, api.port), api.op("watches"), *status(xds.pid))
            api.op("strict", False)
            counts = {int(name[15:19]): v for name, v in stats(admin, MEMBERSHIP).items()}
            attempts = sum(stats(admin, ATTEMPTS).values())
            cpu_before = (cpu_seconds(xds.pid), cpu_seconds(procs[1].pid), api.cpu(), cpu_seconds(os.getpid()))
            wall = time.monotonic()
            for i in range(changes):
                m = i % shape.models
                lists[m][0] = f"10.250.{i // 250 % 250}.{i % 250 + 1}"  # a new address each time
                new_slice = model_slice(shape, m, lists[m])
                t0 = float(api.op("apply", new_slice))
                # Envoy's admin runs on its main thread, where EDS is applied too, and every /stats read
                # walks all stats (ms at 1,000 clusters): read once after the gap, then every `poll`.
                time.sleep(gap)
                deadline = time.monotonic() + 10
                while True:
                    read = time.monotonic()
                    count, updated_ms = cluster_stats(admin, m)
                    result.reads.append(time.monotonic() - read)
                    if count > counts[m]:
                        counts[m] = count
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"change {i} did not reach Envoy")
                    time.sleep(poll)
                detected = time.time()
                t3 = updated_ms / 1000
                # update_time is whole ms: allow 1 ms either side; outside that it is not this update.
                if not t0 - 0.001 <= t3 <= detected + 0.001:
                    raise RuntimeError(f"change {i}: Envoy update_time {t3:.3f} outside [{t0:.3f}, {detected:.3f}]")
                t1 = log.first_after("store", f"m{m:04d}", t0)
                t2 = log.first_after("cache", "-", t1)
                result.samples.append(Sample(t1 - t0, t2 - t1, t3 - t2, t3 - t0))
            wall = time.monotonic() - wall
            cpu_after = (cpu_seconds(xds.pid), cpu_seconds(procs[1].pid), api.cpu(), cpu_seconds(os.getpid()))
            result.cds["eds_per_change"] = (sum(stats(admin, ATTEMPTS).values()) - attempts) // max(1, changes)
            names = ("xds", "envoy", "api", "bench")
            result.cpu = {n: (b - a) / wall for n, a, b in zip(names, cpu_before, cpu_after, strict=True)}
            result.procs["end"] = (tcp_connections(xds.pid, api.port), api.op("watches"), *status(xds.pid))
    finally:
        stop(procs)
        api.close()
    return result


# ---- report ------------------------------------------------------------------------------------


def row(stage: str, models: int, per_model: int, values: list[float], namespaces: int = 1,
        api_process: bool = False) -> list[object]:
    return [label(models, per_model, namespaces, api_process), stage, f"{nearest_rank(values, 50) * 1000:.1f}",
            f"{nearest_rank(values, 99) * 1000:.1f}", f"{max(values) * 1000:.1f}"]


def report(results: list[Result], changes: int, gap: float) -> str:
    rows: list[list[object]] = []
    shape_rows: list[list[object]] = []
    cpu_rows: list[list[object]] = []
    ratios: list[str] = []
    for r in results:
        s = r.shape
        parts = {
            "discovery (t1-t0)": [x.discovery for x in r.samples],
            "rebuild (t2-t1)": [x.rebuild for x in r.samples],
            "push + apply (t3-t2)": [x.push for x in r.samples],
            "total (t3-t0)": [x.total for x in r.samples],
        }
        rows += [row(stage, s.models, s.per_model, values, s.namespaces, r.api_process)
                 for stage, values in parts.items()]
        share = statistics.median(x.discovery / x.total for x in r.samples if x.total > 0)
        p99 = nearest_rank(parts["total (t3-t0)"], 99) * 1000
        ratios.append(f"{r.label}: total p99 {p99:.1f} ms ({'meets' if p99 <= 100 else 'misses'} the 100 ms "
                      f"target); discovery is {share:.0%} of the total (median of per-change ratios)")
        sync, end = r.procs["sync"], r.procs["end"]
        shape_rows.append([r.label, f"{r.sync['xds']:.2f}", f"{r.sync['cds']:.2f}", f"{r.sync['eds']:.2f}",
                           f"{r.sync['synced']:.2f}",
                           f"{r.cds.get('cluster_manager.cds.update_success', 0)}", f"{r.cds['eds_per_change']}",
                           f"{sync[0]} / {end[0]}", f"{sync[1]} / {end[1]}", f"{sync[2]:.0f} / {end[2]:.0f}",
                           f"{sync[3]} / {end[3]}"])
        cpu_rows.append([r.label, *(f"{r.cpu[n]:.0%}" for n in ("xds", "envoy", "api", "bench")),
                         f"{statistics.median(r.reads) * 1000:.1f}"])
    latency = table(["shape", "stage", "p50 ms", "p99 ms", "max ms"], rows)
    shapes = table(["shape", "xDS start -> serving s", "Envoy start -> CDS applied s",
                    "Envoy start -> last EDS applied s", "Envoy start -> all hosts seen s", "CDS updates",
                    "clusters updated per change",
                    "API TCP conns (sync / end)", "open watches (sync / end)", "xDS RSS MiB (sync / end)",
                    "xDS threads (sync / end)"], shape_rows)
    cpu = table(["shape", "xDS process", "Envoy", "fake API server", "benchmark process (incl. inline fake)",
                 "one Envoy /stats read, median ms"], cpu_rows)
    return f"""
{changes} changes per shape, {gap * 1000:.0f} ms apart, round robin over the models; each replaces
one endpoint of one model's EndpointSlice. A shape `M x E @Nns` is M models (one Service each) of E
endpoints, the Services spread over N namespaces (1 unless given). t0: applied to the fake API server
(its schema validation, a test-only cost of 50-70 ms, is done before t0);
t1: the xDS server's SnapshotStore has it; t2: its ResourceCache has the new ResourceSet; t3: Envoy's
`cluster.<name>.update_time` stat for that cluster (1 ms resolution, read after `membership_change`
moved). One Envoy (`--concurrency 1`) is the only ADS client. "(API process)": the fake API server in
its own process instead of a thread of the benchmark process. Target: total p99 <= 100 ms at every shape.

{latency}

{chr(10).join(f"- {r}" for r in ratios)}

p99 is sample {math.ceil(changes * 99 / 100)} of {changes} sorted (nearest rank, as modeldock.bench).

Initial sync and the xDS process. Times are from each process's start (Envoy is started once the xDS
server serves): CDS applied is Envoy's `cluster_manager.cds.update_time`, last EDS applied the newest
`cluster.<name>.update_time` of all model clusters, all hosts seen when admin `/clusters` first listed
every host (polled every 200 ms). Connections are the xDS process's ESTABLISHED TCP connections to the
fake's port (its /proc/<pid>/fd sockets in /proc/net/tcp); open watches are counted by the fake.

{shapes}

CPU used while the changes ran, as a share of one core (over the wall time of the change loop). Envoy's
admin handlers run on its main thread, where EDS is applied, and every `/stats` read walks every stat;
so each change's result is read once, after the gap, not polled while it lands.

{cpu}

{chr(10).join(f"- {line}" for line in limits(results))}
"""


def limits(results: list[Result]) -> list[str]:
    """Which side limits: each shape run both ways, and the busiest process of every run."""
    lines = []
    for r in results:
        busiest = max(("xds", "envoy", "api"), key=lambda n: r.cpu[n])
        lines.append(f"{r.label}: busiest process while changing: {busiest} ({r.cpu[busiest]:.0%} of a core)")
        twin = next((o for o in results if o.shape == r.shape and o.api_process and not r.api_process), None)
        if twin is not None:
            a, b = ([x.discovery for x in q.samples] for q in (r, twin))
            lines.append(f"{r.label}: discovery p50 / p99 / max {nearest_rank(a, 50) * 1000:.1f} / "
                         f"{nearest_rank(a, 99) * 1000:.1f} / {max(a) * 1000:.1f} ms with the fake in this process, "
                         f"{nearest_rank(b, 50) * 1000:.1f} / {nearest_rank(b, 99) * 1000:.1f} / "
                         f"{max(b) * 1000:.1f} ms in its own")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs/benchmarks.md")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes(DEFAULT_SHAPES),
                        help=f"MODELSxENDPOINTS[@Nns],... (default {DEFAULT_SHAPES})")
    parser.add_argument("--api-process", action="store_true", help="run the fake API server in its own process")
    parser.add_argument("--api-compare", type=parse_shapes, default=None,
                        help="shapes to run again with the fake in its own process (default: the largest; '' none)")
    parser.add_argument("--changes", type=int, default=100)
    parser.add_argument("--gap", type=float, default=0.1, help="seconds between changes")
    parser.add_argument("--poll", type=float, default=0.01, help="seconds between Envoy stat reads after the gap")
    args = parser.parse_args()
    compare: list[Shape] = args.api_compare
    if compare is None:
        compare = [] if args.api_process else [max(args.shapes, key=lambda s: (s.models * s.per_model, s.models))]
    runs = [(s, args.api_process) for s in args.shapes] + [(s, True) for s in compare]
    results = []
    for shape, api_process in runs:
        result = run(shape, args.changes, args.gap, args.poll, api_process)
        results.append(result)
        print(f"{result.label}: {len(result.samples)} samples", flush=True)
    body = report(results, args.changes, args.gap)
    print(body)
    if not args.no_write:
        write_section("xds-latency", "xDS latency: EndpointSlice change to Envoy", COMMAND, body)


if __name__ == "__main__":
    main()
