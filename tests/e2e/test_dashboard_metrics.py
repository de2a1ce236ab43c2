"""The Grafana dashboard against a running stack: the series it reads are on the processes' own
/metrics pages (Envoy's /stats/prometheus, ext_proc, xDS, the vLLM simulator), with the labels it uses."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.dashboard import ENVOY_SERIES, Series, load_dashboard, problems, series_from_text
from tests.support.stack import running_stack, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]



def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 (loopback)
        text: str = resp.read().decode()
    return text


def requests_counted(page: str) -> dict[tuple[str, str, str, str], float]:
    """modeldock_requests_total on an ext_proc page: (outcome, status, tenant, model) -> count."""
    return {(s.labels["outcome"], s.labels["status"], s.labels["tenant"], s.labels["model"]): s.value
            for family in text_string_to_metric_families(page) for s in family.samples
            if s.name == "modeldock_requests_total"}


def test_the_dashboard_reads_series_the_running_stack_exports(tmp_path: Path) -> None:
    with running_stack(tmp_path / "run", backends=1) as stack:
        client = stack.openai()
        for _ in range(2):
            client.chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
        with pytest.raises(openai.AuthenticationError):  # a rejection, for modeldock_requests_total's status
            stack.openai(api_key="md-wrong-key-0000000000").models.list()
        with pytest.raises(openai.NotFoundError):  # authenticated, but the client's model name is no label
            client.chat.completions.create(model="no-such-model-7", messages=[{"role": "user", "content": "hi"}])
        extproc = f"http://127.0.0.1:{stack.extproc_metrics_port}/metrics"
        # ext_proc counts a proxied request when its stream ends, just after the client has the answer.
        wait_until(lambda: requests_counted(scrape(extproc)).get(("proxied", "", "acme", "demo-model")) == 2, 5,
                   what="both completions counted under acme and demo-model")
        envoy = scrape(f"{stack.admin_url}/stats/prometheus")
        pages = [scrape(f"http://127.0.0.1:{port}/metrics")
                 for port in (stack.extproc_metrics_port, stack.xds_metrics_port, stack.sims[0].port)]

    # The tenant and model labels the "by tenant and model" panels group by: configured names or empty.
    assert requests_counted(pages[0]) == {("proxied", "", "acme", "demo-model"): 2,
                                          ("rejected", "401", "", ""): 1, ("rejected", "404", "acme", ""): 1}

    # Envoy's page names its counters without _total, so only its samples count.
    live: dict[str, Series] = series_from_text(envoy, derive=False)
    for name, expected in ENVOY_SERIES.items():
        assert name in live, f"Envoy exports no {name}: fix ENVOY_SERIES and the dashboard"
        assert live[name].kind == expected.kind and live[name].labels == expected.labels, (name, live[name])
    assert 'envoy_cluster_name="model_demo-model"' in envoy  # the model:NAME cluster as the panels match it

    for page in pages:
        live.update(series_from_text(page, derive=True))
    found = problems(load_dashboard(), live)
    missing = [p for p in found if "is exported by nothing" in p]
    wrong = [p for p in found if p not in missing]
    assert wrong == []
    assert missing == []  # every series a panel reads is on a live page (queue, tokens and usage included)


def test_a_model_name_with_dots_keeps_one_envoy_cluster_label(tmp_path: Path) -> None:
    """Envoy's tag extraction ends a cluster name at its first dot; the cluster's stat name has none."""

    def dotted(data: dict[str, object], _sims: object) -> None:
        models = data["models"]
        assert isinstance(models, list)
        models.append({**models[0], "name": "llama-3.1-8b", "served_name": "demo-model"})
        for tenant in data["tenants"]:  # type: ignore[attr-defined]
            tenant["models"] = ["*"]

    with running_stack(tmp_path / "run", backends=1, edit_config=dotted) as stack:
        stack.openai().chat.completions.create(model="llama-3.1-8b", max_tokens=2,
                                               messages=[{"role": "user", "content": "hi"}])
        envoy = scrape(f"{stack.admin_url}/stats/prometheus")
    assert 'envoy_cluster_upstream_rq_total{envoy_cluster_name="model_llama-3_1-8b"} 1' in envoy
    assert "_1_8b_upstream" not in envoy and 'envoy_cluster_name="model_llama-3"' not in envoy
