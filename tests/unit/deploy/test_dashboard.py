"""deploy/grafana/modeldock.json: a well-formed Grafana dashboard whose every query names
series that modeldock, the vLLM simulator or Envoy really export, with labels they carry."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from modeldock.admission.metrics import AdmissionMetrics
from modeldock.extproc.app import ExtProcMetrics
from modeldock.extproc.flow import RequestFlow
from modeldock.flowcontrol.metrics import QueueMetrics
from modeldock.gateway import Gateway
from modeldock.picking.metrics import EndpointRow, PickerMetrics, ScrapeMetrics
from modeldock.sharing.sync import SharingMetrics
from modeldock.sim.config import SimConfig
from modeldock.sim.metrics import SimMetrics
from modeldock.usage.metrics import UsageMetrics
from modeldock.usage.record import UsageRecord
from modeldock.xds.app import XdsMetrics
from modeldock.xds.resources import ENDPOINT_TYPE
from tests.support.dashboard import (
    ENVOY_SERIES,
    Dashboard,
    Series,
    exported_series,
    load_dashboard,
    panels,
    problems,
    queries,
    variable_queries,
)
from tests.support.promql import parse


def modeldock_registry() -> CollectorRegistry:
    """Every modeldock collector in one registry, each series touched once through the code
    that feeds it, so its labels show (a labelled family shows none until then)."""
    registry = CollectorRegistry()
    extproc = ExtProcMetrics(registry)
    for outcome, status, tenant, model in (("proxied", 0, "t", "m"), ("rejected", 429, "t", "m"),
                                           ("rejected", 401, "", "")):
        flow = RequestFlow(cast(Gateway, None))
        flow.outcome, flow.status, flow.tenant_id, flow.model_name = outcome, status, tenant, model
        extproc.on_finished(flow, 0.2)
        extproc.on_retried(flow)
    PickerMetrics(registry, "least_load", lambda: [EndpointRow("10.0.0.1:8000", 2, 0.5, 0.1, 0)])
    scrape = ScrapeMetrics(registry)
    scrape.error("timeout")
    scrape.refresh("ok")
    AdmissionMetrics(registry).track_in_flight(lambda: 0)
    queue = QueueMetrics(registry)
    queue.queued("m", "t", "standard", 1)
    queue.on_dispatch("m", "t", "standard", 0.01)
    queue.on_reject("m", "t", "standard", "queue_full")
    queue.on_cancel("m", "t", "standard")
    queue.on_abandon("m")
    queue.on_backfill("m", "t", "standard")
    usage = UsageMetrics(registry)
    usage.observe(UsageRecord(ts=0.0, request_id="r", tenant="t", model="m", served_model="m", endpoint="e",
                              prompt_tokens=3, completion_tokens=2, token_source="estimated", status=200))
    usage.written()
    usage.write_error()
    xds = XdsMetrics(registry)
    xds.connected(1)
    xds.pushed(ENDPOINT_TYPE, 2)
    xds.nacked(ENDPOINT_TYPE, "1", "bad")
    xds.age.labels("m").set(0.5)
    xds.endpoints.labels("m").set(2)
    xds.stale.labels("m").set(0)
    sharing = SharingMetrics(registry)
    for outcome in ("ok", "error", "timeout"):
        sharing.exchanges.labels(outcome).inc()
    return registry


def all_exported() -> dict[str, Series]:
    found = exported_series(modeldock_registry().collect())
    found.update(exported_series(SimMetrics(SimConfig()).registry.collect()))
    found.update(ENVOY_SERIES)
    return found


EXPORTED = all_exported()
DASHBOARD = load_dashboard()


def test_dashboard_is_a_grafana_dashboard_on_a_prometheus_variable() -> None:
    assert DASHBOARD["uid"] and DASHBOARD["title"]
    assert DASHBOARD["schemaVersion"] >= 39  # Grafana 11 and later
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("model", "tenant"):
        var = variables[name]
        assert var["type"] == "query" and var["multi"] and var["includeAll"]
        assert var["allValue"] == ".*"  # "All" must work inside the =~ matchers
        assert var["query"]["query"].startswith("label_values(")
        assert var["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    ids = [p["id"] for p in panels(DASHBOARD)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(DASHBOARD):
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel.get("description"), f"panel {panel['title']!r} says what it shows"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]


def test_every_query_names_series_that_are_exported_with_the_labels_it_uses() -> None:
    assert list(queries(DASHBOARD)) and list(variable_queries(DASHBOARD))
    assert problems(DASHBOARD, EXPORTED) == []


def test_the_series_behind_the_dashboard_were_all_touched() -> None:
    """A labelled family shows its labels only once a child exists: modeldock_registry must
    reach every series the dashboard reads, or the label check above would be blind to it."""
    used = {s.name for _, expr in queries(DASHBOARD) for s in parse(expr).selectors}
    assert sorted(name for name in used if name in EXPORTED and not EXPORTED[name].sampled) == []


def test_every_area_has_a_panel() -> None:
    used = {s.name for _, expr in queries(DASHBOARD) for s in parse(expr).selectors}
    for name in ("modeldock_requests_total", "modeldock_admission_decisions_total", "modeldock_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "envoy_cluster_upstream_rq_time_bucket",
                 "modeldock_queue_length", "modeldock_queue_wait_seconds_bucket", "modeldock_queue_rejected_total",
                 "modeldock_picker_in_flight", "modeldock_picker_score", "modeldock_picker_sample_age_seconds",
                 "modeldock_xds_endpoints", "modeldock_xds_stale", "modeldock_xds_nacks_total",
                 "modeldock_sharing_shared", "modeldock_sharing_peer_in_flight", "modeldock_sharing_exchanges_total"):
        assert name in used, f"no panel reads {name}"


def test_requests_and_errors_by_tenant_and_model() -> None:
    """The row the tenant and model labels of modeldock_requests_total are for, filtered by the variables."""
    assert EXPORTED["modeldock_requests_total"].labels == {"outcome", "status", "tenant", "model"}
    by_title = {p["title"]: p for p in panels(DASHBOARD)}
    assert by_title["Requests and errors by tenant and model"]["type"] == "row"
    for title, grouped in (("Requests by tenant and model", {"tenant", "model"}),
                           ("Errors by tenant and model", {"tenant", "model", "status"})):
        [target] = by_title[title]["targets"]
        query = parse(target["expr"])
        [selector] = query.selectors
        assert selector.name == "modeldock_requests_total" and query.grouping == grouped, title
        assert {"tenant", "model"} <= selector.labels, f"{title} follows the tenant and model variables"
        assert ('outcome="rejected"' in target["expr"]) == title.startswith("Errors"), title


def _edit(change: Callable[[str], str]) -> Dashboard:
    text = change(json.dumps(DASHBOARD))
    edited: Dashboard = json.loads(text)
    return edited


def _first_expr(dashboard: Dashboard, needle: str) -> dict[str, Any]:
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            if needle in target["expr"]:
                return cast(dict[str, Any], target)
    raise AssertionError(f"no query contains {needle}")


@pytest.mark.parametrize(("expr", "expected"), [
    # a typo in a metric name
    ("sum(rate(modeldock_request_total[5m]))", "modeldock_request_total is exported by nothing"),
    # a counter without the _total Prometheus stores it under
    ("sum(rate(modeldock_requests[5m]))", "modeldock_requests is exported by nothing"),
    # a histogram's family name rather than one of its series
    ("sum(rate(modeldock_queue_wait_seconds[5m]))", "modeldock_queue_wait_seconds is exported by nothing"),
    # a label the series does not carry
    ('sum(rate(modeldock_retries_seen_total{tenant=~"$tenant"}[5m]))', "has no label 'tenant'"),
    ("sum by (tenant) (rate(modeldock_retries_seen_total[5m]))", "groups by 'tenant'"),
    ('sum(rate(modeldock_requests_total{tenant_id=~"$tenant"}[5m]))', "has no label 'tenant_id'"),
    ("sum by (endpoint) (rate(modeldock_requests_total[5m]))", "groups by 'endpoint'"),
    # rate() over a gauge, a quantile over a counter
    ("sum(rate(modeldock_queue_length[5m]))", "rate() over modeldock_queue_length, a gauge"),
    ("histogram_quantile(0.9, sum by (le) (rate(modeldock_requests_total[5m])))", "histogram_quantile() over"),
    # a misspelt function
    ("sum(rat(modeldock_requests_total[5m]))", "'rat' is no PromQL function"),
    # Envoy's counters have no _total suffix; vLLM's colon names must match exactly
    ("sum(rate(envoy_cluster_upstream_rq_retry_total[5m]))", "exported by nothing"),
    ("sum(rate(vllm_time_to_first_token_seconds_bucket[5m]))", "exported by nothing"),
])
def test_the_check_fails_on_a_wrong_query(expr: str, expected: str) -> None:
    dashboard = copy.deepcopy(DASHBOARD)
    _first_expr(dashboard, "modeldock_requests_total")["expr"] = expr
    found = problems(dashboard, EXPORTED)
    assert found and any(expected in p for p in found), found


def test_the_check_fails_on_a_wrong_variable_query() -> None:
    dashboard = _edit(lambda text: text.replace("label_values(modeldock_requests_total",
                                                "label_values(modeldock_request_total"))
    assert any("variable 'tenant'" in p and "modeldock_request_total" in p for p in problems(dashboard, EXPORTED))
    dashboard = _edit(lambda text: text.replace("label_values(modeldock_xds_endpoints, model)",
                                                "label_values(modeldock_xds_endpoints, tenant)"))
    assert any("has no label 'tenant'" in p for p in problems(dashboard, EXPORTED))
