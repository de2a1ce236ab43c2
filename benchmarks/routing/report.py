"""The `routing` section of docs/benchmarks.md: results pooled per (policy, workload), the tables, the
default-vs-round_robin headline and the explanations filled in with the run's numbers. Also the number
formatting the cross-check report shares."""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks._report import table
from benchmarks.routing.driver import Timed
from benchmarks.routing.rotations import Run
from benchmarks.routing.stacks import sim_args
from benchmarks.routing.workloads import Workload
from modeldock.bench.stats import nearest_rank


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}" if value >= 0.1 else f"{value * 1000:.1f}"



def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"



def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"



def num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"



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
        vals = [v for r in self.runs if (v := r.diag.get(key)) is not None]
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
    rows: list[list[object]] = []
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
    class_rows: list[list[object]] = []
    for w in workloads:
        kinds = [k for k in w.kinds() if k != "shared"]
        for k in kinds:
            class_rows.append([w.name, k, *[ms(grid[(p, w.name)].kind_p95(k)) if (p, w.name) in grid else "-"
                                            for p in policies]])
    by_class = table(["workload", "requests", *[f"{p} TTFT p95 ms" for p in policies]], class_rows)

    # Load on the machine.
    load_rows: list[list[object]] = []
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
    diag_rows: list[list[object]] = []
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
        shared_tokens = shared_w.params["groups"] * shared_w.params["prefix_tokens"]
        why += f"""

**Prefix caching and `shared`: only `default` is prefix-aware.** It hashes the first blocks of each prompt
and prefers an endpoint that was sent the same beginning recently, within a load bound (`routing.weights.prefix`,
see modeldock/picking/README.md), so a group's requests mostly stay on the backends that hold its
{shared_w.params['prefix_tokens']}-token prefix. The other policies rank by load only and spread each group over
all {args.backends} backends, which then have to hold, or recompute, every group's prefix:
{shared_w.params['groups']} × {shared_w.params['prefix_tokens']:,} = {shared_tokens:,} tokens against
{args.num_gpu_blocks * 16:,} tokens of KV cache per backend, so prefixes keep evicting each other. Prefix hits:
{hits}.{gain}{ref_text}"""
    wl_lines = "\n".join(f"- **{w.name}**: {w.description}; {len(w.requests)} requests over {w.duration:g} "
                         f"simulated s ({w.duration / args.speed:.1f} s wall); parameters `{json.dumps(w.params)}`."
                         for w in workloads)
    plot_md = f"\n![TTFT p50 and p95 per policy and workload]({plot_name})\n" if plot_name else ""
    slow = getattr(args, "slow_factor", 1.0)  # absent in the raw results of runs before the option
    uneven = f"; the last one at {slow:g}x the others' speed" if slow != 1.0 else ""
    body = f"""
{args.backends} simulated vLLM backends (`modeldock sim {' '.join(sim_args(args))}`: {args.max_num_seqs} running
sequences at most, a KV cache of {args.num_gpu_blocks} blocks = {args.num_gpu_blocks * 16:,} tokens each, prefix
caching on{uneven}) behind the real gateway (Envoy + ext_proc + xDS, started by `modeldock/devstack/stack.py`),
one fresh stack per policy. Every policy gets exactly the same seeded requests (seed {args.seed}), sent
**open-loop**: each
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
            out.append(f"""**Why `default` does not beat `round_robin` on `bursts`.** """
                       f"""A burst's {w.params['size']} requests
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
            out.append(f"**`default` did not beat `round_robin` on `{w.name}`** in this run; "
                       "see the diagnostics above.")
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

