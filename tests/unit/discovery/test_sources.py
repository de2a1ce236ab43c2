"""Discovery sources come from one factory; the xDS server gets the config's values."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes.client import ApiClient, Configuration

from modeldock.clock import FakeClock
from modeldock.config import parse_config
from modeldock.discovery.snapshot import SnapshotStore
from modeldock.discovery.sources import DiscoverySource, kube_watch_timeout, sources_from_config
from modeldock.types import Endpoint
from modeldock.xds.app import XdsOptions, XdsServer

KUBE = {"name": "k", "kubernetes": {"namespace": "ns", "service": "svc", "port": "http"}}
STATIC = {"name": "s", "endpoints": ["10.0.0.1:8000"]}


def _client(_kubeconfig: str | None) -> ApiClient:
    configuration = Configuration()
    configuration.host = "http://127.0.0.1:9"  # never contacted: nothing runs
    return ApiClient(configuration)


@pytest.mark.parametrize(("stale_after", "timeout"), [(150.0, 50), (15.0, 5), (2.0, 1)])
def test_one_factory_makes_each_source_with_the_config_values(tmp_path: Path, stale_after: float,
                                                              timeout: int) -> None:
    config = parse_config({"models": [STATIC, KUBE, {**STATIC, "name": "s2"}],
                           "discovery": {"stale_after_seconds": stale_after}})
    store = SnapshotStore(FakeClock())
    asked: list[str | None] = []
    sources: list[DiscoverySource] = sources_from_config(
        config, store, config_path=tmp_path / "c.yaml", kubeconfig="kc",
        api_client=lambda kc: (asked.append(kc), _client(kc))[1])
    assert [(s.kind, s.models) for s in sources] == [("static", frozenset({"s", "s2"})),
                                                      ("kubernetes", frozenset({"k"}))]
    assert asked == ["kc"]
    assert kube_watch_timeout(stale_after) == timeout
    assert sources[1].settings.watch_timeout_seconds == timeout  # type: ignore[attr-defined]
    assert store.current.endpoints("s") == (Endpoint.parse("10.0.0.1:8000"),)  # static publishes at once


def test_static_only_config_needs_no_kubernetes_client(tmp_path: Path) -> None:
    def refuse(_kubeconfig: str | None) -> ApiClient:
        raise AssertionError("no model asked for Kubernetes")

    sources = sources_from_config(parse_config({"models": [STATIC]}), SnapshotStore(FakeClock()),
                                  config_path=tmp_path / "c.yaml", api_client=refuse)
    assert [s.kind for s in sources] == ["static"]


@pytest.mark.parametrize("stale_after", [150.0, 15.0])
def test_xds_server_gets_the_staleness_cutoff(tmp_path: Path, stale_after: float) -> None:
    config = parse_config({"models": [STATIC], "discovery": {"stale_after_seconds": stale_after}})
    clock = FakeClock()
    server = XdsServer(config, XdsOptions(tmp_path / "c.yaml"), clock=clock)
    server.store.update("s", [Endpoint.parse("10.0.0.1:8000")])
    clock.advance(100.0)  # stale under a 15 s cutoff, fresh under 150 s
    stale = server.builder.stale_models(server.store.current, clock.monotonic())
    assert stale == (frozenset() if stale_after > 100 else frozenset({"s"}))
    server.rebuild()
    assert server.registry.get_sample_value("modeldock_xds_stale", {"model": "s"}) == (0 if stale_after > 100 else 1)
