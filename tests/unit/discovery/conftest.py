from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import kubernetes
import pytest

from modeldock.clock import FakeClock
from modeldock.config import KubernetesTarget, ModelConfig
from modeldock.discovery.kubernetes import KubernetesDiscovery
from modeldock.discovery.snapshot import SnapshotStore
from modeldock.types import Endpoint
from tests.support.fake_kube import FakeKubeServer


@pytest.fixture
def kube() -> Iterator[FakeKubeServer]:
    with FakeKubeServer() as server:
        yield server


@pytest.fixture
def kube_client(kube: FakeKubeServer) -> Iterator[kubernetes.client.ApiClient]:
    client = kube.api_client()
    yield client
    client.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> SnapshotStore:
    return SnapshotStore(clock)


def kube_model(name: str, service: str = "vllm", port: int | str = "http", namespace: str = "llm") -> ModelConfig:
    return ModelConfig(name=name, kubernetes=KubernetesTarget(namespace=namespace, service=service, port=port))


def eps(*addresses: str) -> tuple[Endpoint, ...]:
    return tuple(sorted(Endpoint.parse(a) for a in addresses))


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


async def wait_endpoints(
    store: SnapshotStore, model: str, expected: tuple[Endpoint, ...], timeout: float = 5.0
) -> None:
    try:
        await wait_until(lambda: model in store.current.models and store.current.endpoints(model) == expected, timeout)
    except AssertionError:
        raise AssertionError(f"{model}: expected {expected}, have {store.current.endpoints(model)}") from None


def kube_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("modeldock-kube")]


@asynccontextmanager
async def running(discovery: KubernetesDiscovery) -> AsyncIterator[asyncio.Task[None]]:
    """Run discovery in a task; on exit cancel it and check every worker thread is gone."""
    task = asyncio.create_task(discovery.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert not [t for t in discovery.threads if t.is_alive()]


def discovery_for(
    models: list[ModelConfig], store: SnapshotStore, client: kubernetes.client.ApiClient, **kwargs: Any
) -> KubernetesDiscovery:
    settings: dict[str, Any] = {
        "watch_timeout_seconds": 30,
        "request_timeout_seconds": 2.0,
        "backoff_base_seconds": 0.05,
        "backoff_max_seconds": 0.2,
    }
    return KubernetesDiscovery(models, store, client, **(settings | kwargs))
