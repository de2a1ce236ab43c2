"""How long an EndpointSlice change takes to reach Envoy, and which part is discovery.

A FakeKubeServer (tests/support/fake_kube.py) runs in this process; the xDS
server runs as its own process watching it through a kubeconfig (a small
wrapper, `--serve`, that also prints when its SnapshotStore and its
ResourceCache change); a real Envoy takes CDS and EDS from it over ADS.
For each change, one endpoint of one model's EndpointSlice is replaced, and
four wall-clock times are taken (all processes read the same system clock):

    t0  the slice is applied to the fake API server
    t1  the xDS server's SnapshotStore has the new endpoints  (discovery)
    t2  its ResourceCache has the new ResourceSet              (rebuild)
    t3  Envoy applied the EDS update: the cluster's `update_time` stat (ms),
        read once its `membership_change` counter has moved    (push + apply)

    .venv/bin/python -m benchmarks.xds_latency             # writes the xds-latency section of docs/benchmarks.md
    .venv/bin/python -m benchmarks.xds_latency --no-write  # print only
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from benchmarks._report import table, write_section
from modeldock.bench.stats import nearest_rank
from modeldock.config import load_config
from modeldock.discovery.snapshot import Snapshot
from modeldock.envoy import BootstrapOptions, envoy_binary, render_bootstrap
from modeldock.up import free_port

NAMESPACE, PORT_NAME, PORT = "llm", "http", 8000
COMMAND = ".venv/bin/python -m benchmarks.xds_latency"
# Envoy must not outlive this script, even if it is killed: PR_SET_PDEATHSIG survives execve.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


# ---- the xDS server process ----------------------------------------------------------------------


async def serve_child(config_path: str, kubeconfig: str, port: int) -> None:
    """The xDS server, printing `store <model> <time>` and `cache <time>` as they change."""
    import signal

    from modeldock.xds.app import XdsOptions, XdsServer

    config = load_config(config_path)
    server = XdsServer(config, XdsOptions(Path(config_path), port=port, kubeconfig=kubeconfig))
    seen: dict[str, tuple[object, ...]] = {}

    def on_store(snapshot: Snapshot) -> None:
        now = time.time()
        for model, entry in snapshot.models.items():
            before = seen.get(model)
            if before is not entry.endpoints and before != entry.endpoints:
                seen[model] = entry.endpoints
                print(f"store {model} {now:.6f}", flush=True)

    # Subscribed before start(): runs before the server's own rebuild hook on every swap.
    server.store.subscribe(on_store)
    server.cache.add_listener(lambda: print(f"cache - {time.time():.6f}", flush=True))
    await server.start()
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(0)


@dataclass
class ChildLog:
    """What the xDS server process printed, with a condition to wait on."""

    lines: list[tuple[str, str, float]] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def follow(self, stream: object) -> None:
        for raw in stream:  # type: ignore[attr-defined]
            text = raw.decode().strip()
            if text == "ready":
                self.ready.set()
                continue
            parts = text.split()
            if len(parts) == 3 and parts[0] in ("store", "cache"):
                with self.cond:
                    self.lines.append((parts[0], parts[1], float(parts[2])))
                    self.cond.notify_all()

    def first_after(self, kind: str, model: str, after: float, timeout: float = 10.0) -> float:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for k, m, t in self.lines:
                    if k == kind and (model == "-" or m == model) and t >= after:
                        return t
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no {kind} line for {model} after {after}")
                self.cond.wait(remaining)


# ---- the run -----------------------------------------------------------------------------------


def address(model: int, endpoint: int) -> str:
    return f"10.{model // 256 % 256}.{model % 256}.{endpoint + 1}"


def model_slice(model: int, addresses: list[str]) -> dict[str, object]:
    from tests.support.fake_kube import make_slice

    return make_slice(f"svc-{model:03d}-a", NAMESPACE, f"svc-{model:03d}", [(a, True, False) for a in addresses],
                      PORT_NAME, PORT)


def admin_get(admin: str, path: str) -> str:
    with urllib.request.urlopen(f"{admin}{path}", timeout=5) as resp:  # noqa: S310 (loopback)
        return str(resp.read().decode())


def cluster_stats(admin: str, model: int) -> tuple[int, int]:
    """(membership_change, update_time in ms) of the model's cluster."""
    text = admin_get(admin, f"/stats?filter=^cluster[.]model_m{model:03d}[.](membership_change|update_time)$")
    values = dict(re.findall(r"\.(membership_change|update_time): (\d+)", text))
    return int(values.get("membership_change", 0)), int(values.get("update_time", 0))


def envoy_synced(admin: str, models: int, per_model: int) -> bool:
    import json

    try:
        data = json.loads(admin_get(admin, "/clusters?format=json"))
    except OSError:
        return False
    hosts = {c["name"]: len(c.get("host_statuses", [])) for c in data.get("cluster_statuses", [])}
    return all(hosts.get(f"model:m{i:03d}") == per_model for i in range(models))


@dataclass
class Sample:
    discovery: float  # t1 - t0
    rebuild: float  # t2 - t1
    push: float  # t3 - t2
    total: float  # t3 - t0


def wait(predicate: object, timeout: float, what: str, proc: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        for p in proc:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[:3]} exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def run(models: int, per_model: int, changes: int, gap: float, poll: float) -> list[Sample]:
    from tests.support import fake_kube
    from tests.support.fake_kube import FakeKubeServer

    strict = fake_kube.validate

    samples: list[Sample] = []
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="xds-latency-") as tmp, FakeKubeServer() as kube:
        lists = {m: [address(m, e) for e in range(per_model)] for m in range(models)}
        for m, addrs in lists.items():
            kube.apply(model_slice(m, addrs))
        config = Path(tmp) / "config.yaml"
        config.write_text(yaml.safe_dump({"models": [
            {"name": f"m{m:03d}", "kubernetes": {"namespace": NAMESPACE, "service": f"svc-{m:03d}", "port": PORT_NAME}}
            for m in range(models)]}))
        kubeconfig = kube.write_kubeconfig(Path(tmp) / "kubeconfig")
        xds_port, admin_port = free_port(), free_port()
        log = ChildLog()
        xds = subprocess.Popen([sys.executable, __file__, "--serve", str(config), str(kubeconfig), str(xds_port)],
                               stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        procs.append(xds)
        try:
            threading.Thread(target=log.follow, args=(xds.stdout,), daemon=True).start()
            wait(log.ready.is_set, 60, "the xDS server", procs)
            bootstrap = Path(tmp) / "envoy.yaml"
            bootstrap.write_text(render_bootstrap(BootstrapOptions(
                listen_port=free_port(), admin_port=admin_port, xds_port=xds_port, extproc_port=free_port())))
            with open(Path(tmp) / "envoy.log", "wb") as envoy_log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", _DIE_WITH_PARENT, envoy_binary(), "-c", str(bootstrap),
                     "--use-dynamic-base-id", "--concurrency", "1", "--log-level", "warn"],
                    stdin=subprocess.DEVNULL, stdout=envoy_log, stderr=subprocess.STDOUT))
            admin = f"http://127.0.0.1:{admin_port}"
            wait(lambda: envoy_synced(admin, models, per_model), 60, "Envoy to load every cluster", procs)
            time.sleep(1.0)
            # The fake validates every object against the official schema, 50-70 ms per apply on
            # this machine: a test-only cost. Each slice is validated when built, before t0, and
            # the fake's own re-validation is switched off while timing.
            fake_kube.validate = lambda _obj: None
            for i in range(changes):
                m = i % models
                lists[m][0] = f"10.250.{i // 250 % 250}.{i % 250 + 1}"  # a new address each time
                new_slice = model_slice(m, lists[m])
                before, _ = cluster_stats(admin, m)
                t0 = time.time()
                kube.apply(new_slice)
                deadline = time.monotonic() + 10
                while True:
                    count, updated_ms = cluster_stats(admin, m)
                    if count > before:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"change {i} did not reach Envoy")
                    time.sleep(poll)
                detected = time.time()
                t3 = updated_ms / 1000
                # update_time is whole ms: allow 1 ms either side; outside that it is not this update.
                if not t0 - 0.001 <= t3 <= detected + 0.001:
                    raise RuntimeError(f"change {i}: Envoy update_time {t3:.3f} outside [{t0:.3f}, {detected:.3f}]")
                t1 = log.first_after("store", f"m{m:03d}", t0)
                t2 = log.first_after("cache", "-", t1)
                samples.append(Sample(t1 - t0, t2 - t1, t3 - t2, t3 - t0))
                time.sleep(gap)
        finally:
            fake_kube.validate = strict
            for p in reversed(procs):
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    return samples


# ---- report ------------------------------------------------------------------------------------


def row(label: str, models: int, per_model: int, values: list[float]) -> list[object]:
    return [f"{models} x {per_model}", label, f"{nearest_rank(values, 50) * 1000:.1f}",
            f"{nearest_rank(values, 99) * 1000:.1f}",
            f"{max(values) * 1000:.1f}"]


def report(results: list[tuple[int, int, list[Sample]]], changes: int, gap: float) -> str:
    rows = []
    ratios = []
    for models, per_model, samples in results:
        parts = {
            "discovery (t1-t0)": [s.discovery for s in samples],
            "rebuild (t2-t1)": [s.rebuild for s in samples],
            "push + apply (t3-t2)": [s.push for s in samples],
            "total (t3-t0)": [s.total for s in samples],
        }
        rows += [row(label, models, per_model, values) for label, values in parts.items()]
        share = statistics.median(s.discovery / s.total for s in samples if s.total > 0)
        ratios.append(f"{models} models x {per_model} endpoints: discovery is {share:.0%} of the total "
                      f"(median of per-change ratios)")
    body = table(["models x endpoints per model", "stage", "p50 ms", "p99 ms", "max ms"], rows)
    return f"""
{changes} changes per configuration, {gap * 1000:.0f} ms apart, round robin over the models; each replaces
one endpoint of one model's EndpointSlice (one Service per model). t0: applied to the fake API server
(its schema validation, a test-only cost of 50-70 ms, is done before t0);
t1: the xDS server's SnapshotStore has it; t2: its ResourceCache has the new ResourceSet; t3: Envoy's
`cluster.<name>.update_time` stat for that cluster (1 ms resolution, read after `membership_change`
moved). One Envoy (`--concurrency 1`) is the only ADS client.

{body}

{chr(10).join(f"- {r}" for r in ratios)}

p99 is sample {math.ceil(changes * 99 / 100)} of {changes} sorted (nearest rank, as modeldock.bench).
Discovery is the official
`kubernetes` client (a watch thread per Service, JSON decoded into model objects) against the fake API
server, which runs in the benchmark process; rebuild includes waiting for the xDS server's event loop;
push + apply is the ADS stream (SotW) and Envoy's EDS update on its main thread. Every Service's watch
is renewed every `stale_after_seconds / 3` (5 s), which the tail at 100 Services includes.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs/benchmarks.md")
    parser.add_argument("--changes", type=int, default=100)
    parser.add_argument("--gap", type=float, default=0.1, help="seconds between changes")
    parser.add_argument("--poll", type=float, default=0.005, help="seconds between Envoy stat reads")
    parser.add_argument("--serve", nargs=3, metavar=("CONFIG", "KUBECONFIG", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve_child(args.serve[0], args.serve[1], int(args.serve[2])))
        return
    results = []
    for models, per_model in ((10, 10), (100, 100)):
        samples = run(models, per_model, args.changes, args.gap, args.poll)
        results.append((models, per_model, samples))
        print(f"{models} x {per_model}: {len(samples)} samples", flush=True)
    body = report(results, args.changes, args.gap)
    print(body)
    if not args.no_write:
        write_section("xds-latency", "xDS latency: EndpointSlice change to Envoy", COMMAND, body)


if __name__ == "__main__":
    main()
