"""The overload benchmark's report: markdown from the saved results (plain JSON data), so it can
be rewritten from an earlier run (`run.py --report-from RUN_DIR`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from benchmarks._report import table
from benchmarks.overload.plan import ratio

# The targets the queue config is to meet (and the others are measured against).
SERVED_MIN_PCT = 85.0
TTFT_P95_MAX_S = 1.0
PREEMPTION_SHARE_MAX = 0.1
NEIGHBOUR_RATIO_MAX = 1.5
PRIORITY_RATIO_MAX = 1.5
TARGET_CONFIG = "queue"
BASELINE = "noqueue"


def declared(a: dict[str, Any]) -> str:
    """What the model entry told the gateway of the backends (older results have no flag: declared nothing)."""
    if a.get("learn_limit", True):
        return "The model entry does not declare the backends' batch limit: the gateway learns it when one queues."
    return (f"Every config's model entry declares the backends' `max_num_seqs: {a['max_num_seqs']}` (what a deployment "
            "starting vLLM with `--max-num-seqs` knows); only the room rules read it.")


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}%"


def x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def mark(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "NOT met")


def errors(agg: dict[str, Any]) -> str:
    other = ", ".join(f"{k}: {v}" for k, v in sorted(agg["other_errors"].items()))
    return other or "none"


def clean(agg: dict[str, Any]) -> str:
    if not agg["r429"]:
        return "-"
    text = f"{agg['r429_clean']}/{agg['r429']}"
    if agg["r429_unchecked"]:
        text += f" ({agg['r429_unchecked']} cut at 300 chars)"
    return text


def section_setup(saved: dict[str, Any]) -> str:
    a, mix, cap = saved["args"], saved["mix"], saved["capacity"]
    rows = []
    for c in saved["configs"]:
        shown = {k: v for k, v in c["yaml"].items() if k not in ("tenants", "models")}
        extra = yaml.safe_dump(shown, default_flow_style=True, sort_keys=False).strip() if shown else "(nothing)"
        rows.append([f"`{c['name']}`", c["description"], f"`{extra}`",
                     "yes" if c["tenant_fields"] else "no"])
    measured = (f"measured on the `{saved['capacity_measured_on']}` stack with a closed loop: "
                f"{cap['concurrency']} concurrent clients (backends x max_num_seqs, so every running slot of the "
                f"pool is kept busy), each sending its next request when the last one ended, for "
                f"{a['cap_duration']:g} s; completions over the last {cap['window_s']:g} s (the first "
                f"{a['cap_warmup']:g} s are warm-up): {cap['completed']} requests, TTFT p95 {ms(cap['ttft_p95'])} ms. "
                "A closed loop cannot overload the pool (it sends only when something ended), so this is the "
                "highest rate the pool sustains with a bounded backlog; every open-loop rate below is a multiple "
                "of it, the same for every config."
                if saved["capacity_measured_on"] else "given with `--capacity` (not measured in this run).")
    return f"""
{a['backends']} simulated backends, `--max-num-seqs {a['max_num_seqs']}`, `--num-gpu-blocks {a['num_gpu_blocks']}`
({a['num_gpu_blocks'] * 16:,} tokens of KV each), `--speed {a['speed']:g}`; the last backend is set to
{a['speed'] * a['slow_factor']:g} with `POST /sim/speed` (a {a['slow_factor']:g}x-speed backend among normal ones).
{declared(a)}
Requests: {1 - mix['long_fraction']:.0%} short answers ({mix['short_tokens']} tokens), {mix['long_fraction']:.0%} long
generations ({mix['long_tokens']} tokens), prompts of {mix['prompt_tokens'][0]}-{mix['prompt_tokens'][1]} tokens,
streamed; kinds are dealt in blocks of 20, so every stretch of a schedule (the capacity run's too) has this mix.
Every schedule is open loop (Poisson arrivals at a fixed rate whatever the answers) and seeded, so each config
gets exactly the same requests at the same offsets. One fresh stack per config, configs run one after another
(one pass; the machine's drift is not averaged out, compare the load column). TTFT is measured by the client from
send to the first content chunk (gateway queueing included), over served requests only; E2E to `[DONE]`.
Percentiles are nearest rank. Each tenant has its own API key.

**Capacity: {cap['rate']:.2f} requests/s**, {measured}

{table(["config", "what", "config it adds", "tenant weight/class written"], rows)}
{same_configs(saved)}"""


def same_configs(saved: dict[str, Any]) -> str:
    """Configs that generate the same YAML: their rows differ only by the machine's run-to-run noise."""
    first: dict[str, str] = {}
    notes = []
    for c in saved["configs"]:
        key = repr(c["yaml"]) + repr(c["tenant_fields"])
        if key in first:
            notes.append(f"`{c['name']}` generates exactly the same config as `{first[key]}`, so the difference "
                         "between their rows below is this machine's run-to-run noise, not a config effect.")
        else:
            first[key] = c["name"]
    return "\n" + "\n".join(notes) + "\n" if notes else ""


def section_overload(saved: dict[str, Any]) -> str:
    res = saved["results"]
    names = [c["name"] for c in saved["configs"] if "overload" in res[c["name"]]]
    if not names:
        return ""
    base = res[BASELINE]["overload"]["run"]["preemptions"] if BASELINE in names else None
    rows = []
    for n in names:
        s = res[n]["overload"]
        r, agg = s["run"], s["run"]["all"]
        rows.append([f"`{n}`", f"{s['rate']:.1f}/s ({agg['offered']})", pct(agg["served_pct"]), pct(agg["r429_pct"]),
                     clean(agg), errors(agg),
                     f"{ms(agg['ttft_p50'])} / {ms(agg['ttft_p95'])} / {ms(agg['ttft_p99'])}",
                     f"{ms(agg['e2e_p50'])} / {ms(agg['e2e_p95'])}", f"{r['preemptions']:.0f}",
                     x(ratio(r["preemptions"], base)) if base else "-", f"{r['load1']:.1f}"])
    text = f"""
### 1. Overload: {saved['args']['overload']:g}x capacity for {saved['args']['overload_s']:g} s

{table(["config", "offered", "served", "429", "clean 429 JSON", "other errors", "served TTFT p50/p95/p99 ms",
        "E2E p50/p95 ms", "preemptions", "vs noqueue", "load"], rows)}

"clean 429 JSON": 429 answers whose body parses as `{{"error": {{"message", "type", "param", "code"}}}}`.
Preemptions: the simulators' `vllm:num_preemptions_total`, summed, before and after the phase.
"""
    if TARGET_CONFIG in names:
        r = res[TARGET_CONFIG]["overload"]["run"]
        agg = r["all"]
        pre_ok = r["preemptions"] <= PREEMPTION_SHARE_MAX * base if base is not None else None
        text += (f"\nTargets for `{TARGET_CONFIG}`: served >= {SERVED_MIN_PCT:g}% of offered: "
                 f"{mark(agg['served_pct'] is not None and agg['served_pct'] >= SERVED_MIN_PCT)} "
                 f"({pct(agg['served_pct'])}); served TTFT p95 <= {TTFT_P95_MAX_S * 1000:.0f} ms: "
                 f"{mark(agg['ttft_p95'] is not None and agg['ttft_p95'] <= TTFT_P95_MAX_S)} "
                 f"({ms(agg['ttft_p95'])} ms); "
                 f"preemptions <= {PREEMPTION_SHARE_MAX:g}x `{BASELINE}`: {mark(pre_ok)} "
                 f"({r['preemptions']:.0f} vs {base if base is not None else '-'}).\n")
    return text


def _pair_rows(res: dict[str, Any], names: Sequence[str], scenario: str, who: str, others: Sequence[str],
               target: float) -> tuple[list[list[Any]], str]:
    rows, verdict = [], ""
    for n in names:
        s = res[n][scenario]
        alone, both = s["alone"]["tenants"][who], s["both"]["tenants"][who]
        r = ratio(both["ttft_p95"], alone["ttft_p95"])
        ci = s["both"]["ttft_p95_ci"].get(who)
        r429 = " / ".join(f"{s['both']['tenants'][t]['r429']}" for t in [*others, who] if t in s["both"]["tenants"])
        served = " / ".join(pct(s["both"]["tenants"][t]["served_pct"]) for t in [*others, who]
                            if t in s["both"]["tenants"])
        rows.append([f"`{n}`", ms(alone["ttft_p95"]), ms(both["ttft_p95"]),
                     f"{ms(ci[0])}-{ms(ci[1])}" if ci else "-", x(r), served, r429,
                     errors(s["both"]["all"]), f"{s['both']['load1']:.1f}"])
        if n == TARGET_CONFIG:
            verdict = (f"Target for `{TARGET_CONFIG}`: <= {target:g}x alone: {mark(r is not None and r <= target)} "
                       f"({x(r)}).")
    return rows, verdict


def section_noisy(saved: dict[str, Any]) -> str:
    res = saved["results"]
    names = [c["name"] for c in saved["configs"] if "noisy" in res[c["name"]]]
    if not names:
        return ""
    rows, verdict = _pair_rows(res, names, "noisy", "bob", ["alice"], NEIGHBOUR_RATIO_MAX)
    s0 = res[names[0]]["noisy"]
    a_n, b_n = s0["both"]["tenants"]["alice"]["offered"], s0["both"]["tenants"]["bob"]["offered"]
    return f"""
### 2. Noisy neighbour: two tenants of equal weight, {saved['args']['noisy_s']:g} s

Each tenant's share is half the capacity ({s0['share']:.1f}/s). A (`alice`) offers 3x her share ({a_n} requests),
B (`bob`) half of his ({b_n} requests), on the same schedule alone and with A.

{table(["config", "B alone TTFT p95 ms", "B with A TTFT p95 ms", "90% interval (with A)", "with / alone",
        "served A / B", "429s A / B", "other errors", "load"], rows)}

{verdict}
"""


def section_priority(saved: dict[str, Any]) -> str:
    res = saved["results"]
    names = [c["name"] for c in saved["configs"] if "priority" in res[c["name"]]]
    if not names:
        return ""
    rows, verdict = _pair_rows(res, names, "priority", "ivy", ["bat"], PRIORITY_RATIO_MAX)
    s0 = res[names[0]]["priority"]
    return f"""
### 3. Priority: interactive at steady load while batch floods, {saved['args']['priority_s']:g} s

`ivy` (class `interactive`, short answers only) offers {s0['interactive_rate']:.1f}/s
({saved['args']['interactive']:g}x capacity); `bat` (class `batch`, the mix) floods at {s0['batch_rate']:.1f}/s
({saved['args']['flood']:g}x capacity). Columns as above, with A = batch, B = interactive.

{table(["config", "interactive alone TTFT p95 ms", "with batch TTFT p95 ms", "90% interval (with batch)",
        "with / alone", "served batch / interactive", "429s batch / interactive", "other errors", "load"], rows)}

{verdict}
"""


def section_below(saved: dict[str, Any]) -> str:
    res = saved["results"]
    names = [c["name"] for c in saved["configs"] if "below" in res[c["name"]]]
    if not names:
        return ""
    base = res[BASELINE]["below"]["run"] if BASELINE in names else None
    rows = []
    for n in names:
        s = res[n]["below"]
        r, agg = s["run"], s["run"]["all"]
        ci = r["ttft_p95_ci"].get("main")
        cpu_us, base_us = net_cpu_us(r), net_cpu_us(base) if base else None
        rows.append([f"`{n}`", f"{s['rate']:.1f}/s ({agg['offered']})", pct(agg["served_pct"]), errors(agg),
                     f"{ms(agg['ttft_p50'])} / {ms(agg['ttft_p95'])}", f"{ms(ci[0])}-{ms(ci[1])}" if ci else "-",
                     x(ratio(agg["ttft_p95"], base["all"]["ttft_p95"])) if base else "-",
                     "-" if cpu_us is None else f"{cpu_us:.0f}", gross_cpu(r), x(ratio(cpu_us, base_us)),
                     f"{r['preemptions']:.0f}", f"{r['load1']:.1f}"])
    shed = [f"`{n}` refused {pct(res[n]['below']['run']['all']['r429_pct'])}" for n in names
            if res[n]["below"]["run"]["all"]["r429"]]
    shed_text = ("Below capacity, " + ", ".join(shed) + " of the requests with 429 (a config that sheds with room "
                 "left in the pool).\n") if shed else ""
    idle_s = saved["args"].get("idle_s", 0)
    return f"""
### 4. Below capacity: {saved['args']['below']:g}x capacity for {saved['args']['below_s']:g} s

{table(["config", "offered", "served", "errors", "TTFT p50 / p95 ms", "p95 90% interval", "p95 vs noqueue",
        "ext_proc CPU µs/request (net)", "idle CPU, % of a core", "net CPU vs noqueue", "preemptions", "load"], rows)}

The 90% interval is a bootstrap of the p95 over this run's requests: two configs whose intervals overlap are equal
within noise. ext_proc CPU is user + system time of the ext_proc process from /proc (10 ms clock ticks): over the
phase, minus what it used per second while idle ({idle_s:g} s just before: scraping the backends'
/metrics, xDS) times the phase's length, divided by the requests offered. On a loaded 2-core machine this is
noisy to some tens of percent; it is a ratio of two numbers measured minutes apart.

{shed_text}"""


def net_cpu_us(r: dict[str, Any]) -> float | None:
    """ext_proc CPU per request offered, idle CPU over the phase's length subtracted (µs)."""
    n = r["all"]["offered"]
    if not n:
        return None
    idle = (r.get("extproc_idle_cpu_per_s") or 0.0) * r["wall_s"]
    return (r["extproc_cpu_s"] - idle) / n * 1e6


def gross_cpu(r: dict[str, Any]) -> str:
    idle = r.get("extproc_idle_cpu_per_s")
    return "-" if idle is None else f"{idle * 100:.1f}%"


def body(saved: dict[str, Any]) -> str:
    """The whole section; with several runs (`--replicas`), the per-config tables are the first run's and
    report_replicas adds the classes, ratios, replica counts, kill and Redis-down tables."""
    from benchmarks.overload.report_replicas import sections  # it imports this module's helpers

    parts = [section_setup(saved), section_overload(saved), section_noisy(saved), section_priority(saved),
             section_below(saved), *sections(saved),
             f"\nTotal wall time of the benchmark: {saved['elapsed_s'] / 60:.1f} min. "
             "Raw results: `--run-dir DIR` keeps DIR/results.json and every process log.\n"]
    return "\n".join(p for p in parts if p)
