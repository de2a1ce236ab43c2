"""The ADS servicer over real gRPC: streams held until the server has its first state.

A new xDS server listens at once but answers only once discovery has listed (or
its first-list wait ran out). A client that reconnects meanwhile keeps an open
stream instead of failing: Envoy's reconnect backoff grows with each failure (up
to 30 s), and a late reconnect can come after the staleness cutoff.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from modeldock.clock import FakeClock
from modeldock.config import ModelConfig, parse_config
from modeldock.discovery.snapshot import SnapshotStore
from modeldock.types import Endpoint
from modeldock.xds.app import XdsOptions, XdsServer
from modeldock.xds.builder import ResourceBuilder
from modeldock.xds.cache import ResourceCache
from modeldock.xds.resources import CLUSTER_TYPE, ENDPOINT_TYPE, endpoints_of
from modeldock.xds.server import AdsServicer
from tests.support.fake_kube import FakeKubeServer, make_slice

pytestmark = pytest.mark.timeout(30)

HELD = 0.3  # long enough for a held stream to have been answered, had it been served


@pytest.fixture
def kube() -> Iterator[FakeKubeServer]:
    with FakeKubeServer() as server:
        yield server


def cache_with(model: str, endpoint: Endpoint) -> ResourceCache:
    store = SnapshotStore(FakeClock())
    store.update(model, [endpoint])
    cache = ResourceCache()
    cache.set(ResourceBuilder([ModelConfig(name=model, endpoints=[endpoint.address])], stale_after=15)
              .build(store.current, 0.0))
    return cache


class Client:
    """One SotW ADS stream; requests are queued, responses read on demand."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.outgoing: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()
        self.call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources(self._requests())

    async def _requests(self) -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
        while (item := await self.outgoing.get()) is not None:
            yield item

    def send(self, type_url: str, names: list[str] = ()) -> None:  # type: ignore[assignment]
        self.outgoing.put_nowait(discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=list(names)))

    def close(self) -> None:
        self.outgoing.put_nowait(None)
        self.call.cancel()


@asynccontextmanager
async def serving(servicer: AdsServicer) -> AsyncIterator[Client]:
    server = grpc.aio.server()
    ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            client = Client(channel)
            try:
                yield client
            finally:
                client.close()
    finally:
        servicer.close_streams()
        await server.stop(0.1)


def assignment_of(response: discovery_pb2.DiscoveryResponse) -> dict[str, tuple[Endpoint, ...]]:
    out = {}
    for packed in response.resources:
        cla = endpoint_pb2.ClusterLoadAssignment()
        packed.Unpack(cla)
        out[cla.cluster_name] = endpoints_of(cla)
    return out


async def test_held_stream_is_answered_once_serving() -> None:
    servicer = AdsServicer(cache_with("m", Endpoint("127.0.0.1", 9001)), serving=False)
    async with serving(servicer) as client:
        client.send(ENDPOINT_TYPE, ["model:m"])
        first: asyncio.Future[Any] = asyncio.ensure_future(client.call.read())
        await asyncio.sleep(HELD)
        assert not first.done(), "answered before serving"
        assert servicer.streams == 0, "a held stream is not counted as served"
        servicer.start_serving()
        response = await asyncio.wait_for(first, 5)
        assert assignment_of(response) == {"model:m": (Endpoint("127.0.0.1", 9001),)}
        assert servicer.streams == 1


async def test_close_streams_ends_a_held_stream_without_an_answer() -> None:
    servicer = AdsServicer(cache_with("m", Endpoint("127.0.0.1", 9001)), serving=False)
    async with serving(servicer) as client:
        client.send(CLUSTER_TYPE)
        first: asyncio.Future[Any] = asyncio.ensure_future(client.call.read())
        await asyncio.sleep(HELD)
        servicer.close_streams()
        assert await asyncio.wait_for(first, 5) is grpc.aio.EOF
        assert await asyncio.wait_for(client.call.code(), 5) == grpc.StatusCode.OK


async def test_server_listens_during_the_first_list_and_answers_with_its_result(tmp_path: Path,
                                                                                 kube: FakeKubeServer) -> None:
    data = {"models": [{"name": "m", "kubernetes": {"namespace": "llm", "service": "vllm", "port": "http"}}],
            "discovery": {"stale_after_seconds": 15}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    kube.apply(make_slice("vllm-a", "llm", "vllm", [("127.0.0.1", True, False)], "http", 9001))
    kube.pause()  # the first list hangs
    xds = XdsServer(parse_config(data), XdsOptions(path, port=0, tick_seconds=0.05,
                                                   kubeconfig=str(kube.write_kubeconfig(tmp_path / "kubeconfig"))))
    starting = asyncio.ensure_future(xds.start())
    try:
        deadline = asyncio.get_running_loop().time() + 2  # well within the first-list wait (5 s)
        while not xds.bound_port and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert xds.bound_port and not starting.done(), "the server does not listen while it waits for the first list"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{xds.bound_port}") as channel:
            client = Client(channel)
            try:
                client.send(ENDPOINT_TYPE, ["model:m"])
                first: asyncio.Future[Any] = asyncio.ensure_future(client.call.read())
                await asyncio.sleep(HELD)
                assert not first.done(), "answered before the first list"
                kube.resume()
                response = await asyncio.wait_for(first, 5)
                # The listed endpoints, not the empty state the server had while it waited.
                assert assignment_of(response) == {"model:m": (Endpoint("127.0.0.1", 9001),)}
                await asyncio.wait_for(starting, 5)
            finally:
                client.close()
    finally:
        kube.resume()
        if not starting.done():
            starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await xds.stop(0.1)
