"""CPU the whole gateway stack spends per request, as a ratio to Envoy alone in the same run.

The stack is what `modeldock up` runs with the default config (no budgets, usage records off):
Envoy with modeldock's bootstrap, ext_proc and xDS, in front of two simulators. The baseline is
an Envoy with a static cluster and no filters (`gateway_latency.ENVOY_ONLY`) in front of the same
simulator. The two paths alternate round by round (in reverse every other round), so machine noise
hits them alike; CPU is read from /proc for Envoy + ext_proc + xDS (the stack) and for the
baseline Envoy, so a regression in any of the three processes shows as a higher ratio.

A third path, `ungated`, is a second Envoy on the same ext_proc and xDS with the usage filters always on
(as before they were gated on `modeldock:usage`): its Envoy CPU against the stack's Envoy is what the gate saves.

Workloads: non-streaming one-token chat completions at concurrency 1 / 16 / 64 (CPU-ms per
request, and requests per second at the highest tier), and streamed completions of 50 content
chunks at concurrency 16 (CPU-seconds per 1,000 streams).

    .venv/bin/python -m benchmarks.stack_cpu [--requests 1000] [--streams 300] [--rounds 3]
        [--set scrape.refresh_gap_seconds=0]   (a config value for the stack, to compare two runs)
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from benchmarks._load import load
from benchmarks._proc import cpu_seconds
from benchmarks._report import write_section
from benchmarks.gateway_latency import ENVOY_ONLY  # the baseline path: a static Envoy, the router alone
from modeldock.devstack.stack import API_KEY, running_stack, wait_until
from modeldock.envoy import BootstrapOptions, envoy_binary, render_bootstrap
from modeldock.up import Supervisor, free_port

CHUNKS = 50
STACK_PARTS = ("envoy", "extproc", "xds")
SIM_ARGS = ("--speed", "1000", "--max-num-seqs", "2048", "--num-gpu-blocks", "200000")



def _edit(settings: list[str]) -> Callable[[dict[str, object], object], None]:
    """edit_config: each `a.b=value` (value as YAML) set into the stack's config."""
    def edit(data: dict[str, object], _sims: object) -> None:
        for setting in settings:
            path, _, text = setting.partition("=")
            *parents, leaf = path.split(".")
            node = data
            for key in parents:
                node = node.setdefault(key, {})  # type: ignore[assignment]
            node[leaf] = yaml.safe_load(text)
    return edit


def _ungated(bootstrap: str) -> str:
    """The bootstrap with each matcher-wrapped filter unwrapped: the usage filters on every request."""
    config = yaml.safe_load(bootstrap)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    for f in hcm["http_filters"]:
        if "extension_config" in f["typed_config"]:
            f["typed_config"] = f["typed_config"]["extension_config"]["typed_config"]
    return yaml.safe_dump(config, sort_keys=False)


def _start_ungated(sup: Supervisor, run_dir: Path, tmp: Path) -> tuple[str, int]:
    """A second Envoy on the stack's ext_proc and xDS, filters ungated; (url, pid)."""
    stack_bootstrap = yaml.safe_load((run_dir / "envoy.yaml").read_text())
    clusters = {c["name"]: c for c in stack_bootstrap["static_resources"]["clusters"]}

    def port_of(name: str) -> int:
        port: int = clusters[name]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
            "socket_address"]["port_value"]
        return port
    port, admin = free_port(), free_port()
    path = tmp / "ungated.yaml"
    path.write_text(_ungated(render_bootstrap(BootstrapOptions(
        listen_port=port, admin_port=admin, xds_port=port_of("modeldock_xds"),
        extproc_port=port_of("modeldock_extproc"), node_id="modeldock-ungated"))))
    # The stack's Envoy flags (its access log flushed every 20 ms): any difference but the filters shows as a ratio.
    envoy = sup.start("envoy-ungated", [envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--log-level",
                                        "warn", "--drain-time-s", "1", "--file-flush-interval-msec", "20"])
    wait_until(lambda: _up(f"http://127.0.0.1:{admin}/ready"), 20, what="ungated Envoy")
    return f"http://127.0.0.1:{port}/v1", envoy.proc.pid


async def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """{path: {workload: CPU ms per request, or rps}} over all rounds."""
    with tempfile.TemporaryDirectory() as tmp, running_stack(Path(tmp) / "stack", backends=2, sim_args=SIM_ARGS,
                                                             log_level="info", edit_config=_edit(args.set)) as stack:
        sup = Supervisor(Path(tmp))
        port, admin = free_port(), free_port()
        plain = Path(tmp) / "plain.yaml"
        plain.write_text(ENVOY_ONLY.format(admin=admin, port=port, sim=stack.sims[0].port))
        try:
            baseline = sup.start("envoy-plain", [envoy_binary(), "-c", str(plain), "--use-dynamic-base-id",
                                                 "--log-level", "warn"])
            wait_until(lambda: _up(f"http://127.0.0.1:{admin}/ready"), 20, what="plain Envoy")
            ungated_url, ungated_pid = _start_ungated(sup, stack.run_dir, Path(tmp))
            by_name = {c.name: c.proc.pid for c in stack.sup.children}
            stack_pids = tuple(by_name[n] for n in STACK_PARTS)
            paths: dict[str, tuple[str, str | None, tuple[int, ...]]] = {
                "envoy": (f"http://127.0.0.1:{port}/v1", None, (baseline.proc.pid,)),
                "stack": (stack.base_url, API_KEY, stack_pids),
                "ungated": (ungated_url, API_KEY, (ungated_pid,)),  # its Envoy only: ext_proc is the stack's
            }
            workloads: list[tuple[str, int, int, bool]] = [
                *((f"c={c}", c, args.requests, False) for c in (1, 16, 64)),
                ("streams", 16, args.streams, True),
            ]
            cpu: dict[tuple[str, str], float] = {}
            wall: dict[tuple[str, str], float] = {}
            sent: dict[tuple[str, str], int] = {}
            errors = 0
            for url, token, _pids in paths.values():  # warm-up: connections and lazily built state
                await load(url, 200, 16, token=token)
                await load(url, 20, 16, token=token, stream_chunks=CHUNKS, deadline=600)
            for round_ in range(args.rounds):
                order = list(paths.items()) if round_ % 2 == 0 else list(paths.items())[::-1]
                for label, concurrency, count, stream in workloads:
                    for name, (url, token, pids) in order:
                        await asyncio.sleep(args.settle)
                        before, started = [cpu_seconds(p) for p in pids], time.monotonic()
                        _done, errs = await load(url, count, concurrency, token=token,
                                                 stream_chunks=CHUNKS if stream else 0, deadline=600)
                        wall[(name, label)] = wall.get((name, label), 0.0) + time.monotonic() - started
                        used = [cpu_seconds(p) - b for p, b in zip(pids, before, strict=True)]
                        cpu[(name, label)] = cpu.get((name, label), 0.0) + sum(used)
                        if name == "stack":  # which of the three processes it went to
                            for part, seconds in zip(STACK_PARTS, used, strict=True):
                                cpu[(f"stack:{part}", label)] = cpu.get((f"stack:{part}", label), 0.0) + seconds
                                sent[(f"stack:{part}", label)] = sent.get((f"stack:{part}", label), 0) + count
                        sent[(name, label)] = sent.get((name, label), 0) + count
                        errors += errs
        finally:
            sup.stop_all()
    result: dict[str, dict[str, float]] = {}
    for (name, label), seconds in cpu.items():
        result.setdefault(name, {})[label] = seconds / sent[(name, label)] * 1000
    for name in ("envoy", "stack"):
        result[name]["rps c=64"] = sent[(name, "c=64")] / wall[(name, "c=64")]
    result["errors"] = {"all": float(errors)}
    return result


def report(result: dict[str, dict[str, float]]) -> str:
    s, e = result["stack"], result["envoy"]
    rows = [[f"CPU ms per non-streaming request, {c}", f"{s[c]:.3f}", f"{e[c]:.3f}", f"{s[c] / e[c]:.2f}x"]
            for c in ("c=1", "c=16", "c=64")]
    rows.append([f"CPU s per 1,000 streams of {CHUNKS} chunks (c=16)", f"{s['streams']:.2f}", f"{e['streams']:.2f}",
                 f"{s['streams'] / e['streams']:.2f}x"])
    parts = [result[f"stack:{p}"] for p in STACK_PARTS]
    u, se = result["ungated"], result["stack:envoy"]
    for c in ("c=1", "c=16", "c=64", "streams"):
        unit = "s per 1,000 streams" if c == "streams" else f"ms per non-streaming request, {c}"
        rows.append([f"Envoy CPU, usage filters gated (the stack's) vs always on, {unit}", f"{se[c]:.3f}",
                     f"{u[c]:.3f} (always on)", f"{se[c] / u[c]:.2f}x"])
    rows.append(["of which Envoy / ext_proc / xDS, ms per request (all non-streaming tiers)",
                 " / ".join(f"{sum(p[c] for c in ('c=1', 'c=16', 'c=64')) / 3:.3f}" for p in parts), "", ""])
    rows.append(["of which Envoy / ext_proc / xDS, s per 1,000 streams",
                 " / ".join(f"{p['streams']:.2f}" for p in parts), "", ""])
    rows.append(["requests per second, c=64", f"{s['rps c=64']:.0f}", f"{e['rps c=64']:.0f}",
                 f"{s['rps c=64'] / e['rps c=64']:.2f}x"])
    lines = ["| measure | stack (Envoy + ext_proc + xDS) | Envoy alone | stack ÷ Envoy |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines.append(f"\nErrors: {result['errors']['all']:.0f}.")
    return "\n".join(lines)


def _up(url: str) -> bool:
    import urllib.request

    try:
        return bool(urllib.request.urlopen(url, timeout=0.5).status == 200)  # noqa: S310
    except OSError:
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000, help="non-streaming requests per tier per round")
    parser.add_argument("--streams", type=int, default=300, help="streams of 50 chunks per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config value for the stack, e.g. scrape.refresh_gap_seconds=0 (repeatable)")
    parser.add_argument("--settle", type=float, default=0.5, help="idle seconds before each measured batch")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    text = report(asyncio.run(run(args)))
    print(text)
    if not args.no_write:
        intro = (f"CPU read from /proc while the paths alternate over {args.rounds} rounds (reversed every other "
                 f"round): {args.requests} non-streaming one-token chat completions per tier per round, and "
                 f"{args.streams} streams of {CHUNKS} chunks per round at c=16, against simulators at 1000x "
                 "speed. `stack` is Envoy + ext_proc + xDS with the default config (no budgets, usage records "
                 "off); the ratio to Envoy alone is what to compare between runs, as both move with the machine. "
                 "The gated/always-on rows compare the stack's Envoy with a second Envoy on the same ext_proc "
                 "whose usage filters run on every request.")
        if args.set:
            intro += f" Config: {', '.join(args.set)}."
        write_section("stack-cpu", "Whole-stack CPU per request, as a ratio to Envoy alone",
                      "python -m benchmarks.stack_cpu", intro + "\n\n" + text)


if __name__ == "__main__":
    main()
