"""Requests per second through Envoy with 1 ext_proc worker against 2 (`modeldock extproc --workers 2`).

One set of simulators (1000x speed, room for every request at once) and one xDS server feed two front
doors: the devstack's Envoy with its one ext_proc process, and a second Envoy (same flags) whose ext_proc
cluster lists the 2 workers of a `modeldock extproc --workers 2`. The two are loaded alternately, round by
round (reversed every other round), with the same batch of non-streaming one-token chat completions at
concurrency 64, so machine noise hits both alike. CPU seconds are read from /proc for the ext_proc
processes, the Envoy of the path, and the whole machine (/proc/stat), so the table shows where the cores
went: on a 2-core machine Envoy, the client and the simulators share the cores the workers would use.

    .venv/bin/python -m benchmarks.workers [--requests 2000] [--rounds 4] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from benchmarks._load import load
from benchmarks._proc import cpu_seconds
from benchmarks._report import table, write_section
from modeldock.config import load_config
from modeldock.devstack.stack import PY, Stack, running_stack, wait_until
from modeldock.envoy import BootstrapOptions, envoy_binary, render_bootstrap
from modeldock.up import Supervisor, envoy_ready, free_port, free_ports

SIM_ARGS = ("--speed", "1000", "--max-num-seqs", "4096", "--num-gpu-blocks", "400000")
CONCURRENCY = 64
_CLK = os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds all cores have spent not idle since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / _CLK


@dataclass
class FrontDoor:
    url: str
    extproc_pids: list[int]
    envoy_pid: int
    sent: int = 0
    errors: int = 0
    wall: float = 0.0
    extproc_cpu: float = 0.0
    envoy_cpu: float = 0.0
    machine_cpu: float = 0.0
    client_cpu: float = 0.0
    sims_cpu: float = 0.0
    rps_rounds: list[float] = field(default_factory=list)


def _port_of(bootstrap: dict[str, object], name: str) -> int:
    clusters = {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}  # type: ignore[index]
    port: int = clusters[name]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"]["port_value"]
    return port


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def start_two_workers(sup: Supervisor, stack: Stack, tmp: Path) -> FrontDoor:
    """`extproc --workers 2` on the stack's xDS and config, and an Envoy listing both workers."""
    xds_port = _port_of(yaml.safe_load((stack.run_dir / "envoy.yaml").read_text()), "modeldock_xds")
    grpc = free_ports(2)
    workers = sup.start("extproc-workers", [*PY, "--log-level", "info", "extproc", "--config",
                                            str(stack.config_path), "--port", str(grpc), "--xds",
                                            f"127.0.0.1:{xds_port}", "--grace", "2", "--workers", "2"])
    port, admin = free_port(), free_port()
    bootstrap = tmp / "envoy-workers.yaml"
    bootstrap.write_text(render_bootstrap(BootstrapOptions(
        listen_port=port, admin_port=admin, xds_port=xds_port, extproc_port=grpc, node_id="modeldock-workers",
        extproc_endpoints=(f"127.0.0.1:{grpc}", f"127.0.0.1:{grpc + 1}"))))
    envoy = sup.start("envoy-workers", [envoy_binary(), "-c", str(bootstrap), "--use-dynamic-base-id",
                                        "--log-level", "warn", "--drain-time-s", "1",
                                        "--file-flush-interval-msec", "20"])  # the stack's Envoy flags
    parsed = load_config(stack.config_path)
    wait_until(lambda: workers.proc.poll() is None and envoy_ready(f"http://127.0.0.1:{admin}", parsed), 60,
               what="Envoy with both workers healthy")
    pids = _children(workers.proc.pid)
    assert len(pids) == 2, f"expected 2 workers under {workers.proc.pid}, found {pids}"
    return FrontDoor(f"http://127.0.0.1:{port}/v1", pids, envoy.proc.pid)


async def run(args: argparse.Namespace) -> dict[str, FrontDoor]:
    with tempfile.TemporaryDirectory() as tmp, running_stack(Path(tmp) / "stack", backends=2, sim_args=SIM_ARGS,
                                                             log_level="info") as stack:
        sup = Supervisor(Path(tmp))
        try:
            by_name = {c.name: c.proc.pid for c in stack.sup.children}
            sims = [pid for name, pid in by_name.items() if name.startswith("sim-")]
            paths = {"1 worker": FrontDoor(stack.base_url, [by_name["extproc"]], by_name["envoy"]),
                     "2 workers": start_two_workers(sup, stack, Path(tmp))}
            for path in paths.values():  # warm-up: connections, lazily built state
                await load(path.url, 300, CONCURRENCY)
            for round_ in range(args.rounds):
                order = list(paths.values()) if round_ % 2 == 0 else list(paths.values())[::-1]
                for path in order:
                    await asyncio.sleep(args.settle)
                    ext0 = sum(cpu_seconds(p) for p in path.extproc_pids)
                    env0, mach0, t0 = cpu_seconds(path.envoy_pid), machine_busy_seconds(), time.monotonic()
                    client0, sims0 = time.process_time(), sum(cpu_seconds(p) for p in sims)
                    done, errors = await load(path.url, args.requests, CONCURRENCY)
                    wall = time.monotonic() - t0
                    path.wall += wall
                    path.machine_cpu += machine_busy_seconds() - mach0
                    path.extproc_cpu += sum(cpu_seconds(p) for p in path.extproc_pids) - ext0
                    path.envoy_cpu += cpu_seconds(path.envoy_pid) - env0
                    path.client_cpu += time.process_time() - client0
                    path.sims_cpu += sum(cpu_seconds(p) for p in sims) - sims0
                    path.sent += done + errors
                    path.errors += errors
                    path.rps_rounds.append(done / wall)
        finally:
            sup.stop_all()
    return paths


def report(paths: dict[str, FrontDoor]) -> str:
    one, two = paths["1 worker"], paths["2 workers"]

    def rps(p: FrontDoor) -> float:
        return (p.sent - p.errors) / p.wall

    rows: list[list[object]] = []
    for name, p in paths.items():
        rows.append([name, f"{rps(p):.0f}", " / ".join(f"{r:.0f}" for r in p.rps_rounds),
                     f"{p.extproc_cpu / p.wall:.2f}", f"{p.extproc_cpu / p.sent * 1000:.2f}",
                     f"{p.envoy_cpu / p.wall:.2f}", f"{p.client_cpu / p.wall:.2f}", f"{p.sims_cpu / p.wall:.2f}",
                     f"{p.machine_cpu / p.wall:.2f} of {os.cpu_count()}",
                     f"{(p.machine_cpu - p.extproc_cpu - p.envoy_cpu - p.client_cpu - p.sims_cpu) / p.wall:.2f}",
                     p.errors])
    text = table(["path", "requests/s (all rounds)", "requests/s per round", "ext_proc cores busy",
                  "ext_proc CPU ms/request", "Envoy cores busy", "client cores busy",
                  "simulators cores busy", "machine cores busy", "of which the rest", "errors"], rows)
    cores = os.cpu_count() or 1
    verdict = (f"\n\n2 workers ÷ 1 worker, requests per second: **{rps(two) / rps(one):.2f}x**. "
               f"The one ext_proc process kept {one.extproc_cpu / one.wall:.2f} of a core busy (its ceiling is 1.0); ")
    per_one, per_two = one.extproc_cpu / one.sent * 1000, two.extproc_cpu / two.sent * 1000
    verdict += (f"ext_proc CPU per request was {per_two:.2f} ms over 2 workers against {per_one:.2f} ms in one "
                f"({per_two / per_one:.2f}x; not broken down; likely two processes competing for the same cores, "
                "each batching fewer streams per wake-up); ")
    busy = min(one.machine_cpu / one.wall, two.machine_cpu / two.wall)
    if busy >= 0.9 * cores:
        verdict += (f"the machine had {busy:.2f} of its {cores} cores busy in both paths, so the limit was the machine "
                    "(Envoy, the client, the simulators and other work share the cores a second worker would take), "
                    "and this ratio says nothing about how workers scale where the cores are free.")
    else:
        verdict += f"the machine had {busy:.2f} of its {cores} cores busy at least."
    return text + verdict


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="requests per path per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--settle", type=float, default=0.5, help="idle seconds before each measured batch")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    text = report(asyncio.run(run(args)))
    print(text)
    if not args.no_write:
        intro = (f"{args.requests} non-streaming one-token chat completions per path per round at concurrency "
                 f"{CONCURRENCY}, over {args.rounds} rounds alternating the two paths (reversed every other round), "
                 "against two simulators at 1000x speed: `1 worker` is the devstack's Envoy with one ext_proc "
                 "process, `2 workers` a second Envoy (same flags) on `modeldock extproc --workers 2`, both on the "
                 "same xDS and config (no budgets, usage records off). Cores busy = CPU seconds per wall second "
                 "during the batches; the machine column counts everything (Envoy, ext_proc, the simulators and "
                 "this client, and whatever else runs on the machine: `the rest`, which includes xDS), so it "
                 "shows when the machine, not ext_proc, is the limit.")
        write_section("workers", "ext_proc workers: 1 against 2 (`--workers`)",
                      "python -m benchmarks.workers", intro + "\n\n" + text)

if __name__ == "__main__":
    main()
