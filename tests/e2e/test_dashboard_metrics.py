"""The Grafana dashboard against a running stack: the series it reads are on the processes' own
/metrics pages (Envoy's /stats/prometheus, ext_proc, xDS, the vLLM simulator), with the labels it uses."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import openai
import pytest

from tests.support.dashboard import ENVOY_SERIES, Series, load_dashboard, problems, series_from_text
from tests.support.stack import running_stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]



def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 (loopback)
        text: str = resp.read().decode()
    return text


def test_the_dashboard_reads_series_the_running_stack_exports(tmp_path: Path) -> None:
    with running_stack(tmp_path / "run", backends=1) as stack:
        client = stack.openai()
        for _ in range(2):
            client.chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=4)
        with pytest.raises(openai.AuthenticationError):  # a rejection, for modeldock_requests_total's status
            stack.openai(api_key="md-wrong-key-0000000000").models.list()
        envoy = scrape(f"{stack.admin_url}/stats/prometheus")
        pages = [scrape(f"http://127.0.0.1:{port}/metrics")
                 for port in (stack.extproc_metrics_port, stack.xds_metrics_port, stack.sims[0].port)]

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
