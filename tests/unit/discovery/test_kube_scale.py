"""Discovery at scale: 1,000 Services on one watch, per-namespace watches, staleness per model."""

from __future__ import annotations

import asyncio
import threading

import kubernetes
import pytest

from modeldock.clock import FakeClock
from modeldock.config import ModelConfig
from modeldock.discovery.kube_cache import Found
from modeldock.discovery.kubernetes import Outbox
from modeldock.discovery.snapshot import Snapshot, SnapshotStore
from modeldock.types import Endpoint
from modeldock.xds.builder import ResourceBuilder
from tests.support.fake_kube import FakeKubeServer, Obj, make_slice
from tests.unit.discovery.conftest import discovery_for, eps, kube_model, kube_threads, running, wait_until

pytestmark = pytest.mark.timeout(90)

Client = kubernetes.client.ApiClient
SERVICES = 1000
STALE_AFTER = 15.0  # discovery.stale_after_seconds, as the xDS server's builder applies it


def ip(service: int, endpoint: int) -> str:
    return f"10.{service // 250}.{service % 250}.{endpoint + 1}"


def service_slice(service: int, *endpoints: int, namespace: str = "llm") -> Obj:
    addresses = [(ip(service, e), True, False) for e in endpoints]
    return make_slice(f"svc-{service:04d}-a", namespace, f"svc-{service:04d}", addresses, "http", 8000)


def models(count: int, namespace: str = "llm", prefix: str = "m") -> list[ModelConfig]:
    return [kube_model(f"{prefix}{i:04d}", service=f"svc-{i:04d}", namespace=namespace) for i in range(count)]


def has(store: SnapshotStore, expected: dict[str, tuple[Endpoint, ...]]) -> bool:
    current = store.current
    return all(model in current.models and current.endpoints(model) == want for model, want in expected.items())


def watches(kube: FakeKubeServer) -> list[str]:
    return [r.path for r in kube.requests if r.is_watch]


async def test_a_thousand_services_in_one_namespace_share_one_watch(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore, clock: FakeClock
) -> None:
    kube.apply_many(service_slice(i, 0, 1) for i in range(SERVICES))
    kube.apply_many(service_slice(i, 0) for i in range(SERVICES, SERVICES + 50))  # Services no model names
    swaps: list[Snapshot] = []
    store.subscribe(swaps.append)
    discovery = discovery_for(models(SERVICES), store, kube_client)
    expected = {f"m{i:04d}": eps(f"{ip(i, 0)}:8000", f"{ip(i, 1)}:8000") for i in range(SERVICES)}
    async with running(discovery):
        await wait_until(lambda: has(store, expected), timeout=30, what="all 1,000 models")
        await wait_until(lambda: kube.open_watches == 1, what="the watch")
        assert len(swaps) == 1, "the whole list is one batch: one snapshot swap, one xDS rebuild"
        assert discovery.outbox is not None and discovery.outbox.calls == 1
        assert len(discovery.threads) == 1 and len(kube_threads()) == 1
        (index,) = discovery.indexes
        assert index.size().slices == SERVICES, "slices of Services no model names are not kept"
        assert index.size().endpoints == 2 * SERVICES

        # One Service changes: its model is updated; the other 999 are confirmed in the same swap.
        clock.advance(5.0)
        before = store.current
        kube.apply(service_slice(500, 0, 1, 2))
        await wait_until(lambda: len(store.current.endpoints("m0500")) == 3, what="the change")
        after = store.current
        assert after.models["m0007"].endpoints is before.models["m0007"].endpoints, "confirmed, not rebuilt"
        assert all(after.age(model, clock.monotonic()) == 0.0 for model in expected)
    requests = kube.requests
    assert [r.is_watch for r in requests] == [False, True], "one list, then one watch, for 1,000 Services"
    assert requests[1].params["labelSelector"] == "kubernetes.io/service-name"
    assert kube.connections == 1, "the list and the watch share one keep-alive connection"


async def test_an_expired_version_in_the_middle_relists_exactly_once(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore
) -> None:
    kube.apply_many(service_slice(i, 0) for i in range(SERVICES))
    discovery = discovery_for(models(SERVICES), store, kube_client)
    async with running(discovery):
        await wait_until(lambda: "m0999" in store.current.models, timeout=30, what="the first list")
        await wait_until(lambda: kube.open_watches == 1, what="the watch")
        # Changes the open watch never delivers, then the history is compacted away.
        kube.pause()
        kube.apply_many(service_slice(i, 1) for i in range(0, SERVICES, 100))
        kube.delete("llm", "svc-0001-a")
        kube.compact()
        kube.resume()
        expected = {f"m{i:04d}": eps(f"{ip(i, 1 if i % 100 == 0 else 0)}:8000") for i in range(SERVICES)}
        expected["m0001"] = ()
        await wait_until(lambda: has(store, expected), timeout=30, what="the re-list")
        await wait_until(lambda: sum(r.is_watch for r in kube.requests) >= 3, what="the watch after it")
        await asyncio.sleep(0.3)  # nothing more follows
    kinds = ["list" if not r.is_watch else "watch:" + ",".join(r.sent) for r in kube.requests]
    assert kinds == ["list", "watch:", "watch:ERROR", "list", "watch:"], kinds


async def test_a_deleted_services_model_goes_stale_only_after_the_cutoff(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore, clock: FakeClock
) -> None:
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    kube.apply(make_slice("vllm-b", "llm", "vllm", [("10.0.0.2", True, False)], "http", 8000))
    kube.apply(make_slice("other-a", "llm", "other", [("10.0.1.1", True, False)], "http", 8000))
    configured = [kube_model("deleted", service="vllm"), kube_model("kept", service="other")]
    builder = ResourceBuilder(configured, STALE_AFTER, started_at=clock.monotonic())

    def stale() -> frozenset[str]:
        return builder.stale_models(store.current, clock.monotonic())

    discovery = discovery_for(configured, store, kube_client)
    async with running(discovery):
        await wait_until(lambda: has(store, {"deleted": eps("10.0.0.1:8000", "10.0.0.2:8000")}), what="the list")
        await wait_until(lambda: kube.open_watches == 1, what="the watch")
        # The Service goes, and its slices with it: the model has no endpoints at once, as before,
        # but it is not stale: the watch vouches that the namespace holds no slice of it.
        clock.advance(4.0)
        kube.delete("llm", "vllm-a")
        kube.delete("llm", "vllm-b")
        await wait_until(lambda: has(store, {"deleted": ()}), what="the deletions")
        assert store.current.age("deleted", clock.monotonic()) == 0.0 and not stale()
        # A quiet namespace stays confirmed, the deleted Service's model with it.
        clock.advance(STALE_AFTER - 1)
        kube.send_bookmark()
        await wait_until(lambda: store.current.age("deleted", clock.monotonic()) == 0.0, what="the bookmark")
        assert not stale()
        # The API server goes: nothing vouches any more. Stale only once the cutoff has passed.
        confirmed_at = clock.monotonic()
        kube.stop()
        await wait_until(lambda: kube.open_watches == 0, what="the watch to be cut")
        await asyncio.sleep(0.2)  # a failure or two; neither confirms
        clock.advance(STALE_AFTER - 0.5)
        assert not stale()
        assert store.current.endpoints("kept") == eps("10.0.1.1:8000"), "the last list is kept until the cutoff"
        clock.advance(1.0)
        assert stale() == {"deleted", "kept"}
        assert clock.monotonic() - confirmed_at > STALE_AFTER
        # The API server is back: the namespace's watch confirms both again, without a re-list.
        kube.start()
        await wait_until(lambda: not stale(), timeout=10, what="a confirmation after the outage")
        assert store.current.endpoints("deleted") == ()
    assert sum(not r.is_watch for r in kube.requests) == 1


async def test_no_model_goes_stale_because_another_one_is_busy(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore, clock: FakeClock
) -> None:
    count = 200
    kube.apply_many(service_slice(i, 0) for i in range(count))
    configured = models(count)
    builder = ResourceBuilder(configured, STALE_AFTER, started_at=clock.monotonic())
    swaps: list[Snapshot] = []
    store.subscribe(swaps.append)
    # No bookmarks and no watch end within the test: only the busy Service's events vouch.
    discovery = discovery_for(configured, store, kube_client, watch_timeout_seconds=300)
    async with running(discovery):
        await wait_until(lambda: "m0199" in store.current.models, timeout=20, what="the first list")
        await wait_until(lambda: kube.open_watches == 1, what="the watch")
        quiet = store.current.models["m0100"].endpoints
        events = 60
        for step in range(events):
            clock.advance(1.0)  # 60 s in all: four times the cutoff
            kube.apply(service_slice(0, 0, step + 1))
            await wait_until(
                lambda s=step: store.current.endpoints("m0000") == eps(f"{ip(0, 0)}:8000", f"{ip(0, s + 1)}:8000"),
                what=f"event {step}",
            )
            assert not builder.stale_models(store.current, clock.monotonic())
        now = clock.monotonic()
        assert max(store.current.age(m.name, now) for m in configured) == 0.0
        assert store.current.models["m0100"].endpoints is quiet, "the others were confirmed, not recomputed"
        assert len(swaps) <= 1 + events, "at most one swap per event, however many models each confirms"
    assert sum(r.is_watch for r in kube.requests) == 1


async def test_several_namespaces_get_one_watch_each(
    kube: FakeKubeServer, kube_client: Client, store: SnapshotStore
) -> None:
    namespaces = ["ns-a", "ns-b", "ns-c"]
    per = 30
    for ns in namespaces:
        kube.apply_many(service_slice(i, 0, namespace=ns) for i in range(per))
    configured = [m for ns in namespaces for m in models(per, namespace=ns, prefix=f"{ns}-")]
    discovery = discovery_for(configured, store, kube_client)
    assert discovery.namespaces == namespaces
    async with running(discovery):
        expected = {m.name: eps(f"{ip(int(m.name[-4:]), 0)}:8000") for m in configured}
        await wait_until(lambda: has(store, expected), timeout=20, what="every namespace's models")
        await wait_until(lambda: kube.open_watches == len(namespaces), what="one watch per namespace")
        assert len(discovery.threads) == len(namespaces) == len(kube_threads())
        # A change in one namespace reaches only its own model.
        kube.apply(service_slice(7, 0, 1, namespace="ns-b"))
        await wait_until(lambda: len(store.current.endpoints("ns-b-0007")) == 2, what="the change")
        assert store.current.endpoints("ns-a-0007") == expected["ns-a-0007"]
    paths = sorted(watches(kube))
    assert paths == [f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices" for ns in namespaces]
    assert sum(not r.is_watch for r in kube.requests) == len(namespaces)
    assert kube.connections == len(namespaces), "one keep-alive connection per namespace"


async def test_the_outbox_hands_a_burst_to_the_loop_in_one_call() -> None:
    delivered: list[tuple[Found, frozenset[str]]] = []
    outbox = Outbox(asyncio.get_running_loop(), lambda found, confirmed: delivered.append((found, confirmed)))
    a, b = Endpoint.parse("10.0.0.1:8000"), Endpoint.parse("10.0.0.2:8000")

    def burst() -> None:
        for i in range(500):
            outbox.post({"m": frozenset({a if i % 2 else b})}, frozenset({f"c{i % 7}"}))

    thread = threading.Thread(target=burst)
    thread.start()
    thread.join()  # the loop is blocked meanwhile: every post joins the first one's delivery
    await asyncio.sleep(0)
    assert outbox.calls == 1
    assert delivered == [({"m": frozenset({a})}, frozenset(f"c{i}" for i in range(7)))], "the newest list wins"
    outbox.post({}, frozenset({"x"}))
    await asyncio.sleep(0)
    assert outbox.calls == 2 and delivered[-1] == ({}, frozenset({"x"}))
