"""The real KubernetesDiscovery and the real client against the fake API server."""

from __future__ import annotations

import asyncio
import logging
import time

import kubernetes
import pytest

from modeldock.clock import FakeClock
from modeldock.discovery.snapshot import SnapshotStore
from tests.support.fake_kube import FakeKubeServer, make_slice
from tests.unit.discovery.conftest import (
    discovery_for,
    eps,
    kube_model,
    kube_threads,
    running,
    wait_endpoints,
    wait_until,
)

Client = kubernetes.client.ApiClient


async def test_initial_list(kube: FakeKubeServer, kube_client: Client, store: SnapshotStore) -> None:
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False), ("10.0.0.2", None, None)], "http", 8000))
    kube.apply(make_slice("vllm-b", "llm", "vllm", [("10.0.0.3", True, False)], "http", 8000))
    kube.apply(make_slice("other", "llm", "other", [("10.9.9.9", True, False)], "http", 8000))
    kube.apply(make_slice("vllm-x", "elsewhere", "vllm", [("10.8.8.8", True, False)], "http", 8000))
    discovery = discovery_for([kube_model("m")], store, kube_client)
    async with running(discovery):
        await wait_endpoints(store, "m", eps("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"))
    lists = [r for r in kube.requests if not r.is_watch]
    assert lists[0].path == "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"
    # One list of the namespace: every slice that belongs to a Service, none that belongs to none.
    assert lists[0].params == {"labelSelector": "kubernetes.io/service-name"}


async def test_empty_service_is_published_as_empty(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore
) -> None:
    discovery = discovery_for([kube_model("m")], store, kube_client)
    async with running(discovery):
        await wait_until(lambda: "m" in store.current.models, what="an empty but confirmed entry")
        assert store.current.endpoints("m") == ()


async def test_watch_added_modified_deleted(kube: FakeKubeServer, kube_client: Client, store: SnapshotStore) -> None:
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    discovery = discovery_for([kube_model("m")], store, kube_client)
    async with running(discovery):
        await wait_endpoints(store, "m", eps("10.0.0.1:8000"))
        await wait_until(lambda: any(r.is_watch for r in kube.requests), what="a watch")

        kube.apply(make_slice("vllm-b", "llm", "vllm", [("10.0.0.2", True, False)], "http", 8000))
        await wait_endpoints(store, "m", eps("10.0.0.1:8000", "10.0.0.2:8000"))

        # Pod 2 goes not-ready, pod 3 arrives terminating: neither is used.
        kube.apply(
            make_slice("vllm-b", "llm", "vllm", [("10.0.0.2", False, False), ("10.0.0.3", True, True)], "http", 8000)
        )
        await wait_endpoints(store, "m", eps("10.0.0.1:8000"))

        kube.apply(make_slice("vllm-b", "llm", "vllm", [("10.0.0.2", True, False)], "http", 8000))
        await wait_endpoints(store, "m", eps("10.0.0.1:8000", "10.0.0.2:8000"))

        kube.delete("llm", "vllm-a")
        await wait_endpoints(store, "m", eps("10.0.0.2:8000"))

        kube.delete("llm", "vllm-b")
        await wait_endpoints(store, "m", ())
    watches = [r for r in kube.requests if r.is_watch]
    assert len(watches) == 1, "events must arrive on the watch, not by re-listing"
    assert watches[0].params["allowWatchBookmarks"] == "true"
    assert watches[0].params["timeoutSeconds"] == "30"
    assert watches[0].sent == ["ADDED", "MODIFIED", "MODIFIED", "DELETED", "DELETED"]


async def test_label_leaving_the_service_removes_the_slice(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore
) -> None:
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    discovery = discovery_for([kube_model("m")], store, kube_client)
    async with running(discovery):
        await wait_endpoints(store, "m", eps("10.0.0.1:8000"))
        await wait_until(lambda: any(r.is_watch for r in kube.requests), what="a watch")
        kube.apply(make_slice("vllm-a", "llm", "renamed", [("10.0.0.1", True, False)], "http", 8000))
        await wait_endpoints(store, "m", ())


async def test_ipv6_and_port_by_name_and_number_and_other_services_share_one_watch(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore
) -> None:
    v6 = make_slice("vllm-v6", "llm", "vllm", [("fd00:0:0:0::1", True, False)], "http", 8000, address_type="IPv6")
    v6["ports"].append({"name": "metrics", "port": 9090, "protocol": "TCP"})
    kube.apply(v6)
    kube.apply(make_slice("vllm-v4", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    models = [
        kube_model("by-name", port="http"),
        kube_model("by-number", port=9090),
        kube_model("missing-port", port="grpc"),
        kube_model("other-service", service="other"),
    ]
    discovery = discovery_for(models, store, kube_client)
    assert discovery.namespaces == ["llm"]
    async with running(discovery):
        await wait_endpoints(store, "by-name", eps("[fd00::1]:8000", "10.0.0.1:8000"))
        await wait_endpoints(store, "by-number", eps("[fd00::1]:9090"))
        await wait_endpoints(store, "missing-port", ())
        await wait_endpoints(store, "other-service", ())
        kube.apply(
            make_slice("vllm-v4", "llm", "vllm", [("10.0.0.1", True, False), ("10.0.0.2", True, False)], "http", 8000)
        )
        await wait_endpoints(store, "by-name", eps("[fd00::1]:8000", "10.0.0.1:8000", "10.0.0.2:8000"))
        assert len(discovery.threads) == 1
        assert kube.open_watches == 1
    assert [r.params["labelSelector"] for r in kube.requests if r.is_watch] == ["kubernetes.io/service-name"]


async def test_merge_and_deduplicate_across_slices(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore
) -> None:
    kube.apply(
        make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False), ("10.0.0.2", True, False)], "http", 8000)
    )
    kube.apply(
        make_slice("vllm-b", "llm", "vllm", [("10.0.0.2", True, False), ("10.0.0.3", True, False)], "http", 8000)
    )
    discovery = discovery_for([kube_model("m")], store, kube_client)
    async with running(discovery):
        await wait_endpoints(store, "m", eps("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"))
        await wait_until(lambda: any(r.is_watch for r in kube.requests), what="a watch")
        # Still in slice b, so deleting a keeps 10.0.0.2.
        kube.delete("llm", "vllm-a")
        await wait_endpoints(store, "m", eps("10.0.0.2:8000", "10.0.0.3:8000"))


async def test_bookmark_confirms_without_a_change(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore, clock: FakeClock
) -> None:
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    snapshots: list[object] = []
    store.subscribe(snapshots.append)
    discovery = discovery_for([kube_model("m")], store, kube_client)
    async with running(discovery):
        await wait_endpoints(store, "m", eps("10.0.0.1:8000"))
        await wait_until(lambda: any(r.is_watch for r in kube.requests), what="a watch")
        before = store.current.models["m"]
        for _ in range(3):
            clock.advance(7.0)
            kube.send_bookmark()
            await wait_until(
                lambda: store.current.models["m"].confirmed_at == clock.monotonic(), what="the bookmark to confirm"
            )
        after = store.current.models["m"]
        assert after.endpoints == before.endpoints
        assert after.confirmed_at == before.confirmed_at + 21.0
        assert store.current.age("m", clock.monotonic()) == 0.0
    watches = [r for r in kube.requests if r.is_watch]
    assert len(watches) == 1 and watches[0].sent == ["BOOKMARK"] * 3


async def test_watch_timeout_resumes_from_the_last_version(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore
) -> None:
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    discovery = discovery_for([kube_model("m")], store, kube_client, watch_timeout_seconds=1)
    async with running(discovery):
        await wait_endpoints(store, "m", eps("10.0.0.1:8000"))
        await wait_until(lambda: any(r.is_watch for r in kube.requests), what="a watch")
        kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.2", True, False)], "http", 8000))
        await wait_endpoints(store, "m", eps("10.0.0.2:8000"))
        kube.send_bookmark()
        await wait_until(lambda: len([r for r in kube.requests if r.is_watch]) >= 2, timeout=4, what="a renewed watch")
    lists = [r for r in kube.requests if not r.is_watch]
    watches = [r for r in kube.requests if r.is_watch]
    assert len(lists) == 1, "a watch that ended on time is resumed, not re-listed"
    # Resumed from the bookmark's resourceVersion, the newest one seen.
    assert int(watches[1].params["resourceVersion"]) == kube.resource_version


async def test_clean_watch_end_confirms_a_quiet_service(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore, clock: FakeClock
) -> None:
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    discovery = discovery_for([kube_model("m")], store, kube_client, watch_timeout_seconds=1)
    async with running(discovery):
        await wait_endpoints(store, "m", eps("10.0.0.1:8000"))
        clock.advance(30.0)  # no events, no bookmarks: only the watch ending on time can vouch
        await wait_until(lambda: store.current.age("m", clock.monotonic()) == 0.0, timeout=3, what="a confirmation")
        assert store.current.endpoints("m") == eps("10.0.0.1:8000")
    assert all(r.sent == [] for r in kube.requests if r.is_watch)


async def test_expired_version_relists_and_converges(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "modeldock.discovery")
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    discovery = discovery_for([kube_model("m")], store, kube_client)
    async with running(discovery):
        await wait_endpoints(store, "m", eps("10.0.0.1:8000"))
        await wait_until(lambda: any(r.is_watch for r in kube.requests), what="a watch")
        # A change the watch never delivers, then the history is compacted away.
        kube.pause()
        kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.7", True, False)], "http", 8000))
        kube.compact()
        kube.resume()
        await wait_endpoints(store, "m", eps("10.0.0.7:8000"))
        await wait_until(lambda: len([r for r in kube.requests if r.is_watch]) >= 3, what="the next watch")
    requests = kube.requests
    kinds = ["list" if not r.is_watch else "watch:" + ",".join(r.sent) for r in requests]
    assert kinds[:4] == ["list", "watch:", "watch:ERROR", "list"], kinds
    assert int(requests[4].params["resourceVersion"]) == kube.resource_version
    assert "resourceVersion expired (410)" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_api_server_gone_then_back(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "modeldock.discovery")
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    discovery = discovery_for([kube_model("m")], store, kube_client)
    async with running(discovery):
        await wait_endpoints(store, "m", eps("10.0.0.1:8000"))
        await wait_until(lambda: any(r.is_watch for r in kube.requests), what="a watch")
        kube.stop()
        kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.2", True, False)], "http", 8000))
        await wait_until(lambda: "failure 3" in caplog.text, what="several failed attempts")
        assert store.current.endpoints("m") == eps("10.0.0.1:8000"), "keep the last list while the API is gone"
        kube.start()
        await wait_endpoints(store, "m", eps("10.0.0.2:8000"))
        await wait_until(
            lambda: any(r.is_watch and r.params["resourceVersion"] == str(kube.resource_version) for r in kube.requests)
        )
        kube.send_bookmark()
        await wait_until(lambda: "watching again" in caplog.text, what="the recovery log")
    assert sum(not r.is_watch for r in kube.requests) == 1, "the watch resumed: nothing was downloaded again"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one warning per failure streak, not one per retry"
    assert "list/watch failed" in warnings[0].getMessage()


async def test_api_server_hanging_then_back(kube: FakeKubeServer, kube_client: Client, store: SnapshotStore) -> None:
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    discovery = discovery_for(
        [kube_model("m")], store, kube_client, watch_timeout_seconds=1, request_timeout_seconds=0.3
    )
    async with running(discovery):
        await wait_endpoints(store, "m", eps("10.0.0.1:8000"))
        await wait_until(lambda: any(r.is_watch for r in kube.requests), what="a watch")
        kube.pause()
        kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.2", True, False)], "http", 8000))
        # The silent watch hits its read timeout (1 + 0.3 s) and the resumed watch hangs too.
        await wait_until(lambda: sum(r.is_watch for r in kube.requests) >= 2, what="a resumed watch")
        assert store.current.endpoints("m") == eps("10.0.0.1:8000")
        kube.resume()
        await wait_endpoints(store, "m", eps("10.0.0.2:8000"))
    lists = [r for r in kube.requests if not r.is_watch]
    assert len(lists) == 1, "a hung watch is resumed from its resourceVersion, not re-listed"


async def test_cancel_stops_a_watching_thread_promptly(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore
) -> None:
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    discovery = discovery_for(
        [kube_model("m"), kube_model("n", service="other", namespace="elsewhere")],
        store,
        kube_client,
        watch_timeout_seconds=60,
    )
    task = asyncio.create_task(discovery.run())
    await wait_endpoints(store, "m", eps("10.0.0.1:8000"))
    await wait_until(lambda: kube.open_watches == 2, what="both namespaces' watches")
    started = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - started < 1.0
    assert not kube_threads()
    # Nothing reaches the store after run() returned.
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.2", True, False)], "http", 8000))
    await asyncio.sleep(0.2)
    assert store.current.endpoints("m") == eps("10.0.0.1:8000")


async def test_cancel_during_backoff_is_prompt(kube: FakeKubeServer, kube_client: Client, store: SnapshotStore) -> None:
    kube.stop()
    discovery = discovery_for([kube_model("m")], store, kube_client, backoff_base_seconds=5.0, backoff_max_seconds=5.0)
    task = asyncio.create_task(discovery.run())
    await asyncio.sleep(0.3)  # the first list is refused; the thread sleeps in its backoff
    started = time.monotonic()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert time.monotonic() - started < 1.0
    assert not kube_threads()
    assert "m" not in store.current.models
