"""Building the API client, and the fake server's own contract."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import kubernetes
import kubernetes_validate
import pytest
import urllib3

from modeldock.discovery.kubernetes import load_api_client, watching_client
from modeldock.discovery.snapshot import SnapshotStore
from tests.support.fake_kube import FakeKubeServer, make_slice
from tests.unit.discovery.conftest import discovery_for, eps, kube_model, kube_threads, running, wait_endpoints

DEFAULT_HOST = kubernetes.client.Configuration.get_default_copy().host


async def test_kubeconfig_client_discovers(kube: FakeKubeServer, store: SnapshotStore, tmp_path: Path) -> None:
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    client = load_api_client(str(kube.write_kubeconfig(tmp_path / "kubeconfig")))
    assert client.configuration.host == kube.url
    assert kubernetes.client.Configuration.get_default_copy().host == DEFAULT_HOST
    async with running(discovery_for([kube_model("m")], store, client)):
        await wait_endpoints(store, "m", eps("10.0.0.1:8000"))
    assert kube.requests[0].headers["authorization"] == "Bearer fake-token"
    client.close()


def test_in_cluster_config_is_used_in_a_pod(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("pod-token")
    ca.write_text("not a real certificate; only the path is read here")
    monkeypatch.setattr(kubernetes.config.incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(kubernetes.config.incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    client = load_api_client(None)
    assert client.configuration.host == "https://10.96.0.1:443"
    assert client.configuration.api_key["BearerToken"] == "bearer pod-token"
    assert client.configuration.ssl_ca_cert == str(ca)
    assert kubernetes.client.Configuration.get_default_copy().host == DEFAULT_HOST


def test_explicit_kubeconfig_wins_in_a_pod(
    monkeypatch: pytest.MonkeyPatch, kube: FakeKubeServer, tmp_path: Path
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    client = load_api_client(str(kube.write_kubeconfig(tmp_path / "kubeconfig")))
    assert client.configuration.host == kube.url


def test_watching_client_turns_off_read_retries_only_on_its_copy(kube: FakeKubeServer) -> None:
    original = kube.api_client()
    ours = watching_client(original)
    assert original.configuration.retries is None
    retries = ours.configuration.retries
    assert isinstance(retries, urllib3.Retry) and retries.read == 0 and retries.total == 3
    assert ours.configuration.host == original.configuration.host
    assert ours.configuration.api_key == original.configuration.api_key


async def test_cancel_while_the_server_hangs(kube: FakeKubeServer, store: SnapshotStore) -> None:
    kube.pause()
    client = kube.api_client()
    discovery = discovery_for([kube_model("m")], store, client, request_timeout_seconds=0.3)
    task = asyncio.create_task(discovery.run())
    await asyncio.sleep(0.1)  # the first list is in flight, unanswered
    assert len(kube.requests) == 1
    started = time.monotonic()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    # A request in flight cannot be interrupted; it ends at its timeout, not four of them.
    assert time.monotonic() - started < 0.3 + 0.5
    assert not kube_threads()


# ---- the fake server itself ---------------------------------------------------


def test_invalid_slices_are_refused(kube: FakeKubeServer) -> None:
    bad = make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000)
    bad["endpoints"][0]["conditions"]["ready"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kube.apply(bad)
    unknown = make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000)
    unknown["endpoints"][0]["weight"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kube.apply(unknown)
    untyped = make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000)
    del untyped["addressType"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kube.apply(untyped)
    assert kube.requests == [] and kube.resource_version == 1000, "nothing was stored"


def test_apply_versions_and_no_op(kube: FakeKubeServer) -> None:
    start = kube.resource_version
    obj = make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000)
    stored = kube.apply(obj)
    assert stored["metadata"]["resourceVersion"] == str(start + 1)
    assert stored["metadata"]["generation"] == 1
    again = kube.apply(obj)
    assert again["metadata"]["resourceVersion"] == str(start + 1), "a no-op apply is not a change"
    obj["endpoints"][0]["conditions"]["ready"] = False
    changed = kube.apply(obj)
    assert changed["metadata"]["uid"] == stored["metadata"]["uid"]
    assert changed["metadata"]["generation"] == 2
    kube.delete("llm", "vllm-a")
    assert kube.resource_version == start + 3


def test_list_wire_format_and_errors(kube: FakeKubeServer) -> None:
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    http = urllib3.PoolManager()
    base = f"{kube.url}/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"
    listing = http.request("GET", base + "?labelSelector=kubernetes.io%2Fservice-name%3Dvllm").json()
    assert listing["kind"] == "EndpointSliceList"
    assert listing["metadata"]["resourceVersion"] == str(kube.resource_version)
    assert [item["metadata"]["name"] for item in listing["items"]] == ["vllm-a"]
    assert http.request("GET", base + "?labelSelector=kubernetes.io%2Fservice-name%3Dother").json()["items"] == []
    old = kube.resource_version
    kube.compact()
    gone = http.request("GET", f"{base}?resourceVersion={old}")
    assert gone.status == 410 and gone.json()["reason"] == "Expired"
    missing = http.request("GET", f"{kube.url}/api/v1/namespaces/llm/pods")
    assert missing.status == 404 and missing.json()["kind"] == "Status"


def test_watch_too_old_is_an_error_event(kube: FakeKubeServer) -> None:
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    old = kube.resource_version
    kube.compact()
    api = kubernetes.client.DiscoveryV1Api(kube.api_client())
    watch = kubernetes.watch.Watch()
    with pytest.raises(kubernetes.client.ApiException) as caught:
        for _ in watch.stream(api.list_namespaced_endpoint_slice, "llm", resource_version=str(old), timeout_seconds=5):
            pass
    assert caught.value.status == 410
    assert kube.requests[-1].sent == ["ERROR"]
