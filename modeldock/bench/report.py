"""Presenting a BenchResult: a human table, JSON, and an optional PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

from modeldock.bench.results import BenchResult, TierResult
from modeldock.bench.stats import Summary

_STAT_COLUMNS = ("count", "mean", "min", "p50", "p95", "p99", "max")


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def to_json(result: BenchResult, include_samples: bool = False) -> str:
    return json.dumps(result.to_dict(include_samples), indent=2)


def format_table(result: BenchResult) -> str:
    blocks = [_tier_block(tier) for tier in result.tiers]
    return "\n\n".join(blocks) + "\n"


def _tier_block(tier: TierResult) -> str:
    p = tier.params
    lines = [
        f"concurrency {p.concurrency} | {p.endpoint} {p.url} model={p.model} "
        f"prompt≈{p.prompt_tokens} max_tokens={p.max_tokens} usage={'on' if p.usage else 'off'} "
        f"warmup={p.warmup} requests={p.requests} started={p.started_at}",
        f"  completed {tier.completed}/{p.requests} in {tier.wall_time_s:.3f} s: "
        f"{tier.requests_per_s:.2f} req/s, {_tokens_per_s(tier)}",
    ]
    if tier.errors:
        counts = ", ".join(f"{kind}: {n}" for kind, n in tier.errors.items())
        lines.append(f"  errors {tier.error_total} ({counts}) - not included in any latency")
        for kind, detail in tier.error_details.items():
            lines.append(f"    {kind}: {_one_line(detail)}")
    header = "  " + f"{'ms':<6}" + "".join(f"{c:>10}" for c in _STAT_COLUMNS)
    lines.append(header)
    for name, summary in (("TTFT", tier.ttft), ("TPOT", tier.tpot), ("E2E", tier.e2e)):
        lines.append("  " + f"{name:<6}" + _summary_cells(summary))
    if tier.tpot.count == 0:
        lines.append("  TPOT needs usage.completion_tokens (run with --usage against a server that reports it)")
    return "\n".join(lines)


def _tokens_per_s(tier: TierResult) -> str:
    if tier.output_tokens_per_s is None:
        return "output tok/s n/a (no usage)"
    return f"{tier.output_tokens_per_s:.1f} output tok/s"


def _summary_cells(summary: Summary) -> str:
    cells = [f"{summary.count:>10}"]
    for name in _STAT_COLUMNS[1:]:
        value: float | None = getattr(summary, name)
        cells.append(f"{'-':>10}" if value is None else f"{value * 1000:>10.1f}")
    return "".join(cells)


def _one_line(text: str, limit: int = 120) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def require_matplotlib() -> None:
    """Raise PlotUnavailable with an install hint when matplotlib is missing."""
    try:
        # Imported lazily so the benchmark itself never needs matplotlib.
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'modeldock[plot]'") from exc


def write_plot(result: BenchResult, path: str | Path) -> None:
    """TTFT distribution (CDF) per tier, and TTFT percentiles against concurrency."""
    require_matplotlib()
    from matplotlib.figure import Figure

    # Figure without pyplot: no global backend state, safe inside other programs.
    figure = Figure(figsize=(12, 4.5), layout="constrained")
    cdf_axes, pct_axes = figure.subplots(1, 2)
    for tier in result.tiers:
        ttfts = sorted(v * 1000 for v in tier.samples()["ttft_s"])
        if ttfts:
            fractions = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            label = f"c={tier.params.concurrency} ({tier.completed} ok, {tier.error_total} errors)"
            cdf_axes.step(ttfts, fractions, where="post", label=label)
    cdf_axes.set(title="TTFT distribution, completed requests", xlabel="TTFT (ms)", ylabel="fraction ≤ x")
    cdf_axes.grid(alpha=0.3)
    if any(t.ttft.count for t in result.tiers):
        cdf_axes.legend(title="concurrency")

    positions = list(range(len(result.tiers)))
    for pct in ("p50", "p95", "p99"):
        values = [_ms(getattr(t.ttft, pct)) for t in result.tiers]
        pct_axes.plot(positions, values, "-o", label=f"TTFT {pct}")
    pct_axes.set_xticks(positions, [str(t.params.concurrency) for t in result.tiers])
    pct_axes.set(title="TTFT nearest-rank percentiles per tier", xlabel="concurrency", ylabel="TTFT (ms)")
    pct_axes.grid(alpha=0.3)
    pct_axes.legend()
    first = result.tiers[0].params if result.tiers else None
    if first is not None:
        figure.suptitle(
            f"{first.model} @ {first.url} ({first.endpoint}, prompt≈{first.prompt_tokens}, "
            f"max_tokens={first.max_tokens}, {first.requests} requests/tier, warmup {first.warmup}, "
            f"started {result.started_at})",
            fontsize="medium",
        )
    figure.savefig(path, dpi=110)


def _ms(seconds: float | None) -> float:
    return float("nan") if seconds is None else seconds * 1000
