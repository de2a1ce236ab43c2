"""The Grafana dashboard in deploy/grafana/ and the check that its queries name series someone exports.

`exported_series` turns Prometheus metric families (from a CollectorRegistry, or parsed from a
live /metrics page) into the series names Prometheus stores, with their type and label names.
`problems` reads every PromQL query of the dashboard and lists what does not match them:
unknown series, label matchers or grouping labels the series do not carry, rate() over a gauge,
histogram_quantile() over anything but a `_bucket` series.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.metrics_core import Metric

from tests.support.promql import COUNTER_FUNCTIONS, PromQLError, Selector, label_values, parse

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "modeldock.json"
# Labels Prometheus adds to every series it scrapes.
TARGET_LABELS = frozenset({"instance", "job"})
# The names Prometheus stores for one family, by the family's type (the text exposition format).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "gauge": ("",),
    "unknown": ("",),
}

Dashboard = dict[str, Any]


@dataclass
class Series:
    kind: str  # the family's type: counter, gauge, histogram, ...
    labels: set[str] = field(default_factory=set)
    sampled: bool = True  # False: only named by its family's type, no sample seen (labels unknown)

    @property
    def rateable(self) -> bool:
        return self.kind in ("counter", "histogram", "summary")


def exported_series(families: Iterable[Metric], derive: bool = True) -> dict[str, Series]:
    """Stored series name -> type and label names. With `derive` (a registry's families), a
    family with no samples yet still names its series, by its type, but shows no labels;
    without it (a scraped page, which may not follow the suffix rules: Envoy's counters have
    no `_total`), only the samples count."""
    found: dict[str, Series] = {}
    for family in families:
        for suffix in SUFFIXES.get(family.type, ("",)) if derive else ():
            found.setdefault(family.name + suffix, Series(family.type, sampled=False))
        for sample in family.samples:
            series = found.setdefault(sample.name, Series(family.type))
            series.labels.update(sample.labels)
            series.sampled = True
    return found


def load_dashboard(path: Path = DASHBOARD) -> Dashboard:
    data: Dashboard = json.loads(path.read_text(encoding="utf-8"))
    return data


def panels(dashboard: Dashboard) -> Iterator[dict[str, Any]]:
    """Every panel, rows' collapsed panels included."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: Dashboard) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]


def variable_queries(dashboard: Dashboard) -> Iterator[tuple[str, str]]:
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            yield f"variable {var['name']!r}", query["query"] if isinstance(query, dict) else query


def problems(dashboard: Dashboard, exported: Mapping[str, Series]) -> list[str]:
    found: list[str] = []
    for where, expr in queries(dashboard):
        try:
            query = parse(expr)
        except PromQLError as err:
            found.append(f"{where}: {err}")
            continue
        if not query.selectors:
            found.append(f"{where}: names no series: {expr}")
        known: set[str] = set(TARGET_LABELS)
        for selector in query.selectors:
            found += _selector_problems(where, selector, exported)
            if selector.name in exported:
                known |= exported[selector.name].labels
        for label in sorted(query.grouping - known):
            found.append(f"{where}: groups by {label!r}, which none of its series carries")
    for where, text in variable_queries(dashboard):
        try:
            selector, label = label_values(text)
        except PromQLError as err:
            found.append(f"{where}: {err}")
            continue
        found += _selector_problems(where, selector, exported)
        if selector.name in exported and label not in exported[selector.name].labels:
            found.append(f"{where}: {selector.name} has no label {label!r}")
    return found


def _selector_problems(where: str, selector: Selector, exported: Mapping[str, Series]) -> list[str]:
    series = exported.get(selector.name)
    if series is None:
        return [f"{where}: {selector.name} is exported by nothing the dashboard reads"]
    found = [f"{where}: {selector.name} has no label {label!r} (it has {sorted(series.labels)})"
             for label in sorted(selector.labels - series.labels - TARGET_LABELS)]
    over = [f for f in selector.functions if f in COUNTER_FUNCTIONS]
    if over and not series.rateable:
        found.append(f"{where}: {over[-1]}() over {selector.name}, a {series.kind}")
    if "histogram_quantile" in selector.functions and not (
            series.kind == "histogram" and selector.name.endswith("_bucket")):
        found.append(f"{where}: histogram_quantile() over {selector.name}, not a histogram's _bucket series")
    return found
