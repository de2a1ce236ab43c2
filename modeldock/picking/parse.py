"""Read the few load series picking needs out of a vLLM /metrics page.

A real page is ~100 KB, almost all histogram buckets. One regex with a
literal prefix (`\\nvllm`) lets the C matcher skip everything else, so only
the handful of matching lines reach Python.
"""

from __future__ import annotations

import math
import re

from modeldock.picking.signals import Sample

_NAMES = r"(num_requests_waiting|num_requests_running|kv_cache_usage_perc|gpu_cache_usage_perc)"
# name, optional {labels}, value; the label group runs to the last `}` on the line.
_TAIL = _NAMES + r"(?:\{([^\n]*)\})?[ \t]+([^ \t\n]+)"
_LINE = re.compile(r"\nvllm([:_])" + _TAIL)
_FIRST = re.compile(r"vllm([:_])" + _TAIL)  # the page's first line has no leading newline


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _names_other_model(labels: str, wanted: str) -> bool:
    """True when `labels` has a model_name label whose (escaped) value is not `wanted`."""
    at = labels.find('model_name="')
    while at > 0 and labels[at - 1] not in ", ":  # e.g. served_model_name: keep looking
        at = labels.find('model_name="', at + 1)
    if at == -1:
        return False
    # Escaped values cannot hold a bare quote, so a prefix match plus the closing quote is exact.
    return not labels.startswith(wanted + '"', at + 12)


def parse_metrics(text: str, model: str | None) -> Sample | None:
    """The served model's load, summed over engines; None if the page has none.

    Series whose `model_name` label differs from `model` are ignored; series
    without the label are taken. `model=None` takes every series. Counts are
    summed over the `engine` label; KV usage (a 0..1 fraction per engine) is
    averaged and clamped to [0, 1], since a sum of fractions means nothing.
    Prefers the `vllm:` spelling and `kv_cache_usage_perc` over the older
    `gpu_cache_usage_perc` when a page carries both.
    """
    totals: dict[tuple[str, str], float] = {}
    counts: dict[tuple[str, str], int] = {}
    first = _FIRST.match(text)
    matches = _LINE.findall(text)
    if first is not None:
        matches.insert(0, first.groups(""))
    wanted = _escape(model) if model is not None else None
    for sep, name, labels, raw in matches:
        if wanted is not None and "model_name" in labels and _names_other_model(labels, wanted):
            continue
        try:
            value = float(raw)
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        key = (sep, name)
        totals[key] = totals.get(key, 0.0) + value
        counts[key] = counts.get(key, 0) + 1
    sep = ":" if any(k[0] == ":" for k in totals) else "_"
    waiting = totals.get((sep, "num_requests_waiting"))
    running = totals.get((sep, "num_requests_running"))
    if waiting is None and running is None:
        return None
    kv_key = (sep, "kv_cache_usage_perc")
    if kv_key not in totals:
        kv_key = (sep, "gpu_cache_usage_perc")
    kv = totals[kv_key] / counts[kv_key] if kv_key in totals else 0.0
    return Sample(
        waiting=max(0.0, waiting or 0.0),
        running=max(0.0, running or 0.0),
        kv=min(1.0, max(0.0, kv)),
    )
