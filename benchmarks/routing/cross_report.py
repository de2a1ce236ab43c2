"""The `cross-check` section of docs/benchmarks.md: the two clients and the simulators' histograms side
by side, and each gap over 10% with its cause as the run's numbers show it."""

from __future__ import annotations

import argparse
import random
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from benchmarks._report import table
from benchmarks.routing.crosscheck import E2E, TTFT, Cross, Probe
from benchmarks.routing.promhist import Histogram, from_values
from benchmarks.routing.report import errors_text, ms, values
from modeldock.bench.stats import nearest_rank


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

    rows: list[list[object]] = [
        ["bench driver (even requests)", len(b_ttft),
         *[ms(bench[k]) + (f" [{ms(ci[k][0])}-{ms(ci[k][1])}]" if k in ci else "") for k in keys]],
        ["openai SDK client (odd requests), vs bench", len(s_ttft),
         *[ms(sdk[k]) + rel(sdk[k], bench[k]) for k in keys]],
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
        saturated_note = ("; the SDK client counts as saturated (p90 lag over 25 ms), so the simulators are compared "
                          "with the bench half" if f["sdk_saturated"] else "")
        parts.append(f"""
### {cross.workload} ({cross.requests} requests)

{text}

Completed: bench driver {f['bench_done']} (errors: {f['bench_errors']}), SDK client {f['sdk_done']} (errors:
{f['sdk_errors']}); the simulators counted {f['hist_counts'][0]:.0f} first tokens and {f['hist_counts'][1]:.0f}
finished requests. About {f['chunks_per_s']:.0f} SSE chunks/s reached the clients in all. CPU over the run: bench
driver {f['bench_cpu']:.0%} of a core, SDK client process {f['sdk_cpu']:.0%} (its import included), i.e. about
{f['bench_us_per_chunk']:.0f} and {f['sdk_us_per_chunk']:.0f} µs per chunk received (request handling included);
send lag p90 / max {ms(f['bench_late_p90'])} / {ms(f['bench_late'])} ms (bench) and {ms(f['sdk_late_p90'])} /
{ms(f['sdk_late'])} ms (SDK){saturated_note}.

Envoy's way in (request received → simulator's response headers) averaged {ms(f['envoy_ttfb'])} ms (p95
{ms(f['envoy_ttfb_p95'])} ms) during this run, against {ms(idle_ttfb)} ms at idle.

Gaps over 10%:

""" + "\n".join(cross_gaps(fixed, f)))
    return "\n".join(parts)

