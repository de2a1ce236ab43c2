"""docs/routing.png: TTFT p50 and p95 per contender, one panel per workload (matplotlib, imported only
when plotting)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from benchmarks.routing.report import cells
from benchmarks.routing.rotations import Run
from benchmarks.routing.workloads import Workload


def plot(runs: Sequence[Run], affinity: Sequence[Run], workloads: Sequence[Workload], lineup: Sequence[str],
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    grid, aff = cells(runs), cells(affinity)
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.8), squeeze=False)
    axes = axes[0]
    for ax, w in zip(axes, workloads, strict=True):
        keys = [(p, w.name) for p in lineup if (p, w.name) in grid]
        if w.name == "shared":
            keys += list(aff.keys())
        names = [k[0].replace(" (reference)", "\n(reference)").replace("_", "\n") for k in keys]
        cellz = [grid.get(k) or aff[k] for k in keys]
        p50 = [(c.stat("ttft", 50) or math.nan) * 1000 for c in cellz]
        p95 = [(c.stat("ttft", 95) or math.nan) * 1000 for c in cellz]
        x = range(len(keys))
        ax.bar([i - 0.2 for i in x], p50, 0.4, label="TTFT p50", color="#9ecae1")
        ax.bar([i + 0.2 for i in x], p95, 0.4, label="TTFT p95", color="#3182bd")
        for i, v in enumerate(p95):
            ax.text(i + 0.2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), names, fontsize=8)
        ax.set_yscale("log")
        finite = [v for v in p50 if v == v]
        ax.set_ylim(bottom=max(1.0, min(finite) / 4) if finite else 1.0, top=max(v for v in p95 if v == v) * 2)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.set_title(w.name)
        ax.set_ylabel("ms (wall clock, log scale)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8)
    fig.suptitle("Routing policies behind the real gateway: TTFT p50 and p95, lower is better", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)

