"""Routing quality of the picking policies, side by side in one run, behind the real gateway.

For each policy (round_robin, least_request, seed, default) a fresh stack is started with
`modeldock.devstack.stack.running_stack` (M simulated vLLM backends + xDS + ext_proc + Envoy, the policy
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

    .venv/bin/python -m benchmarks.routing.run              # ~7.5 minutes on 2 cores
    .venv/bin/python -m benchmarks.routing.run --quick      # a smoke run, ~3 minutes, writes nothing
"""

from __future__ import annotations

import argparse
import json
import pickle
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._report import write_section
from benchmarks.routing.cross_report import cross_section
from benchmarks.routing.crosscheck import Cross, Probe, run_cross_checks
from benchmarks.routing.driver import Timed
from benchmarks.routing.plot import plot
from benchmarks.routing.report import routing_body
from benchmarks.routing.rotations import Run, run_affinity, run_rotations
from benchmarks.routing.stacks import build_workloads

# Run, Cross and Probe must stay names of this module: raw.pickle files written when they were defined
# here call them `__main__.Run` etc., and `--report-from` still reads those files.
__all__ = ["Cross", "Probe", "Run", "main"]

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ("round_robin", "least_request", "seed", "default")
DOC_PNG = ROOT / "docs" / "routing.png"
COMMAND = ".venv/bin/python -m benchmarks.routing.run"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", type=int, default=4)
    parser.add_argument("--speed", type=float, default=1.5, help="simulator time factor (default %(default)s)")
    parser.add_argument("--slow-factor", type=float, default=1.0,
                        help="the last backend's speed relative to the others (0.5: an uneven pool; default even)")
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
