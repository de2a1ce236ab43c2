"""The overload report's parts for request classes and replica counts (`--replicas`): markdown from the
saved results (plain JSON data), as report.py's sections are.

A run is one replica count (and Redis or not): the first run's results are `saved["results"]`, every
run is listed in `saved["runs"]` (key -> replicas, redis, results; the first without its results).
Results saved before per-class figures existed have no "classes": their tables say "-".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks._report import table
from benchmarks.overload.plan import ratio
from benchmarks.overload.report import (
    BASELINE,
    NEIGHBOUR_RATIO_MAX,
    PREEMPTION_SHARE_MAX,
    PRIORITY_RATIO_MAX,
    SERVED_MIN_PCT,
    TTFT_P95_MAX_S,
    mark,
    ms,
    net_cpu_us,
    pct,
    x,
)

E2E_RATIO_MAX = 1.2  # E2E p95 at N replicas against one replica's
RECOVERY_MAX_S = 2.0  # back to shared after Redis returns
CLASSES = ("short", "long")


def runs(saved: dict[str, Any]) -> list[tuple[str, int, bool, dict[str, Any]]]:
    """(key, replicas, Redis, results) of every run, the first first."""
    if "runs" not in saved:
        return [("1", int(saved.get("capacity_measured_replicas", 1)), False, saved["results"])]
    return [(k, r["replicas"], r["redis"], r.get("results", saved["results"])) for k, r in saved["runs"].items()]


def label(replicas: int, redis: bool) -> str:
    return f"{replicas}{' + Redis' if redis and replicas == 1 else ''}"


def _pair(p95: float | None, p99: float | None) -> str:
    return f"{ms(p95)} / {ms(p99)}"


def class_cells(classes: dict[str, Any] | None, pooled: dict[str, Any]) -> list[str]:
    """TTFT p95 / p99 (ms) of short, long and pooled requests."""
    cells = []
    for k in CLASSES:
        agg = (classes or {}).get(k)
        cells.append(_pair(agg["ttft_p95"], agg["ttft_p99"]) if agg else "-")
    return [*cells, _pair(pooled["ttft_p95"], pooled["ttft_p99"])]


def _views(res: dict[str, Any]) -> list[tuple[str, dict[str, Any] | None, dict[str, Any]]]:
    """(phase, per-class aggregates, pooled aggregate) of what each phase is judged on: every request of
    the single-tenant phases, the quiet tenant's in the two-tenant ones."""
    out: list[tuple[str, dict[str, Any] | None, dict[str, Any]]] = []
    for scenario, name in (("overload", "overload"), ("below", "below capacity"), ("kill", "kill"),
                           ("redis_down", "Redis down")):
        if scenario in res:
            r = res[scenario]["run"]
            out.append((name, r.get("classes"), r["all"]))
    for scenario, who, text in (("noisy", "bob", "B"), ("priority", "ivy", "interactive")):
        if scenario in res:
            for part, how in (("alone", "alone"), ("both", "with the flood")):
                r = res[scenario][part]
                out.append((f"{scenario}: {text} {how}", r.get("tenant_classes", {}).get(who), r["tenants"][who]))
    return out


def section_classes(saved: dict[str, Any]) -> str:
    rows: list[list[object]] = []
    for _key, n, redis, results in runs(saved):
        for cfg, res in results.items():
            for name, classes, pooled in _views(res):
                rows.append([label(n, redis), f"`{cfg}`", name, *class_cells(classes, pooled)])
    if not rows:
        return ""
    return f"""
### Per request class: TTFT p95 / p99 ms, short and long apart and pooled

Served requests only. In the noisy-neighbour and priority phases, the quiet tenant's requests (B, interactive).

{table(["replicas", "config", "phase", "short", "long", "pooled"], rows)}
"""


def class_ratios(s: dict[str, Any], who: str) -> dict[str, float | None]:
    """The quiet tenant's TTFT p95 with the flood / alone, per class and pooled."""
    alone, both = s["alone"], s["both"]
    out = {k: ratio((both.get("tenant_classes", {}).get(who, {}).get(k) or {}).get("ttft_p95"),
                    (alone.get("tenant_classes", {}).get(who, {}).get(k) or {}).get("ttft_p95")) for k in CLASSES}
    out["pooled"] = ratio(both["tenants"][who]["ttft_p95"], alone["tenants"][who]["ttft_p95"])
    return out


def worst(ratios: dict[str, float | None], target: float) -> bool | None:
    """Every measured ratio within `target` (None: nothing measured)."""
    values = [v for v in ratios.values() if v is not None]
    return all(v <= target for v in values) if values else None


def section_ratios(saved: dict[str, Any]) -> str:
    rows: list[list[object]] = []
    for _key, n, redis, results in runs(saved):
        for cfg, res in results.items():
            row: list[Any] = [label(n, redis), f"`{cfg}`"]
            for scenario, who, target in (("noisy", "bob", NEIGHBOUR_RATIO_MAX),
                                          ("priority", "ivy", PRIORITY_RATIO_MAX)):
                if scenario not in res:
                    row += ["-"] * 4
                    continue
                r = class_ratios(res[scenario], who)
                row += [x(r["short"]), x(r["long"]), x(r["pooled"]), mark(worst(r, target))]
            if any(v != "-" for v in row[2:]):
                rows.append(row)
    if not rows:
        return ""
    return f"""
### Neighbour and priority ratios per class: the quiet tenant's TTFT p95 with the flood / alone

Targets: noisy neighbour <= {NEIGHBOUR_RATIO_MAX:g}x, priority <= {PRIORITY_RATIO_MAX:g}x, for each class and pooled
("met" when every measured one is). The interactive tenant sends short answers only (its long column is "-").

{table(["replicas", "config", "noisy short", "noisy long", "noisy pooled", "noisy target",
        "priority short", "priority long", "priority pooled", "priority target"], rows)}
"""


def _get(results: dict[str, Any], cfg: str, *path: str) -> Any:
    node: Any = results.get(cfg)
    for p in path:
        if not isinstance(node, dict) or p not in node:
            return None
        node = node[p]
    return node


def section_replicas(saved: dict[str, Any]) -> str:
    """Each run against the first (one replica) on the same schedule, with the issue's targets."""
    all_runs = runs(saved)
    if len(all_runs) < 2:
        return ""
    base = all_runs[0][3]
    rows: list[list[object]] = []
    for key, n, redis, results in all_runs:
        for cfg, res in results.items():
            if "overload" not in res:
                continue
            r = res["overload"]["run"]
            agg = r["all"]
            noq = _get(results, BASELINE, "overload", "run", "preemptions")
            if noq is None:
                noq = _get(base, BASELINE, "overload", "run", "preemptions")
            e2e_x = ratio(agg["e2e_p95"], _get(base, cfg, "overload", "run", "all", "e2e_p95"))
            below = _get(results, cfg, "below", "run")
            below_x = ratio(below["all"]["ttft_p95"], _get(base, cfg, "below", "run", "all", "ttft_p95")) \
                if below else None
            base_below = _get(base, cfg, "below", "run")
            cpu_x = ratio(net_cpu_us(below), net_cpu_us(base_below)) if below and base_below else None
            judged = n >= 2 and key != all_runs[0][0]
            checks = [agg["served_pct"] is not None and agg["served_pct"] >= SERVED_MIN_PCT,
                      agg["ttft_p95"] is not None and agg["ttft_p95"] <= TTFT_P95_MAX_S,
                      r["preemptions"] <= PREEMPTION_SHARE_MAX * noq if noq else None,
                      e2e_x <= E2E_RATIO_MAX if e2e_x is not None else None]
            shown = [mark(c) if judged else "-" for c in checks]
            rows.append([label(n, redis), f"`{cfg}`", f"{pct(agg['served_pct'])} {shown[0]}",
                         f"{ms(agg['ttft_p95'])} {shown[1]}",
                         f"{r['preemptions']:.0f} ({x(ratio(r['preemptions'], noq))} of noqueue) {shown[2]}",
                         f"{ms(agg['e2e_p95'])} ({x(e2e_x)}) {shown[3]}", x(below_x), x(cpu_x)])
    return f"""
### Replicas: the same schedule at 1, 2 and 3 replicas

Each replica is a whole stack (xDS, ext_proc, Envoy on its own ports) in front of the same simulated backends;
with 2+ replicas (and "1 + Redis") every config has `limits.redis_url` pointing at one real Redis. The client
sends arrivals round robin over the replicas' Envoys; in the noisy-neighbour and priority phases the flooding
tenant arrives through replica 0 and the quiet one through replica 1. The capacity was measured once, on the
first run, and every run gets the same seeded schedules. Targets at 2+ replicas (overload phase): served >=
{SERVED_MIN_PCT:g}%, TTFT p95 <= {TTFT_P95_MAX_S * 1000:.0f} ms, preemptions <= {PREEMPTION_SHARE_MAX:g}x the
no-queue run's (at the same replica count, else one replica's), E2E p95 <= {E2E_RATIO_MAX:g}x one replica's.

{table(["replicas", "config", "served", "TTFT p95 ms", "preemptions", "E2E p95 ms (vs 1)",
        "below: TTFT p95 vs 1", "below: ext_proc CPU/request vs 1"], rows)}
"""


def _in_flight(values: Sequence[float | None]) -> str:
    return ", ".join("-" if v is None else f"{v:.0f}" for v in values) or "-"


def section_kill(saved: dict[str, Any]) -> str:
    rows: list[list[object]] = []
    for _key, n, redis, results in runs(saved):
        for cfg, res in results.items():
            if "kill" not in res:
                continue
            k = res["kill"]
            ends = k["in_flight_end"]
            zero = all(v == 0 for v in ends) if ends and None not in ends else None
            rows.append([label(n, redis), f"`{cfg}`", f"{k['rate']:.1f}/s", f"r{k['victim']}",
                         f"{k['failed_at_kill']}/{k['sent_to_victim_before']}", str(k["failed_other"]),
                         str(k.get("r429_other", "-")),
                         f"{_count(k['preemptions_before'])} / {_count(k['preemptions_after'])}",
                         f"{k['run']['preemptions']:.0f}", pct(k["run"]["all"]["served_pct"]),
                         f"{_in_flight(ends)} {mark(zero)}"])
    if not rows:
        return ""
    after = next(res["kill"]["after_s"] for _, _, _, results in runs(saved) for res in results.values()
                 if "kill" in res)
    return f"""
### Kill one replica mid-run

At {saved['args'].get('kill_load', 1.0):g}x capacity for {saved['args'].get('kill_s', 0):g} s, round robin; a
third of the way in the last replica's whole stack (xDS, ext_proc, Envoy) is SIGKILLed and its clients send to
the next live replica. "failed on it": requests sent through the killed replica before it died that did not
complete (cut by the kill), of all sent to it by then; other failures and 429s: of every other request.
Preemptions over the {after:g} s before / after the kill,
from the simulators' counters sampled every 0.25 s. In flight at the end: each survivor's `modeldock_in_flight`
once the backends are idle (target: 0).

{table(["replicas", "config", "offered", "killed", "failed on it", "other failures", "other 429s",
        f"preemptions {after:g} s before / after", "preemptions (phase)", "served", "in flight at the end"], rows)}
"""


def _count(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def section_redis_down(saved: dict[str, Any]) -> str:
    rows: list[list[object]] = []
    for _key, n, redis, results in runs(saved):
        for cfg, res in results.items():
            if "redis_down" not in res:
                continue
            d = res["redis_down"]
            rec = d["recovery_s"]
            if rec is None:
                back, ok = "-", None
            else:
                back = ", ".join("never" if v is None else f"{v:.1f}" for v in rec)
                ok = all(v is not None and v <= RECOVERY_MAX_S for v in rec)
            rows.append([label(n, redis), f"`{cfg}`", f"{d['rate']:.1f}/s",
                         f"{d['failed']} {mark(d['failed'] == 0)}", str(d.get("r429", "-")),
                         pct(d["run"]["all"]["served_pct"]),
                         f"{d['run']['preemptions']:.0f}", f"{back} {mark(ok)}" if rec is not None else "-"])
    if not rows:
        return ""
    return f"""
### Redis down mid-run

At {saved['args'].get('kill_load', 1.0):g}x capacity for {saved['args'].get('redis_down_s', 0):g} s, round robin;
Redis is SIGKILLed a third of the way in and started again (empty, same port) at two thirds. Failed requests:
any that did not complete, 429s apart (the gateway shedding at capacity; target: 0 failed). Back to shared:
seconds from Redis answering again until each replica's `modeldock_sharing_peers` is above 0, polled every
0.1 s (target: <= {RECOVERY_MAX_S:g} s; "-": the ext_proc does not export the metric).

{table(["replicas", "config", "offered", "failed", "429s", "served", "preemptions",
        "back to shared, s per replica"], rows)}
"""


def sections(saved: dict[str, Any]) -> list[str]:
    return [section_classes(saved), section_ratios(saved), section_replicas(saved), section_kill(saved),
            section_redis_down(saved)]
