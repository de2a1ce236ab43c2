"""The delta ADS state machine through a fake stream, and once over real gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from pathlib import Path

import grpc
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from modeldock.clock import FakeClock
from modeldock.config import ModelConfig, parse_config
from modeldock.discovery.snapshot import SnapshotStore
from modeldock.types import Endpoint
from modeldock.xds.app import XdsOptions, XdsServer
from modeldock.xds.builder import ResourceBuilder
from modeldock.xds.cache import ResourceCache
from modeldock.xds.delta import DeltaStream
from modeldock.xds.protocol import StreamEvents
from modeldock.xds.resources import CLUSTER_TYPE, ENDPOINT_TYPE, endpoints_of

MODELS = [ModelConfig(name="a", endpoints=["10.0.0.1:8000"]), ModelConfig(name="b", endpoints=["10.0.0.2:8000"])]
A, B = "model:a", "model:b"

Response = discovery_pb2.DeltaDiscoveryResponse


class Recorder(StreamEvents):
    def __init__(self) -> None:
        self.pushes = 0
        self.acks: list[str] = []
        self.nacks: list[tuple[str, str]] = []

    def pushed(self, type_url: str, count: int) -> None:
        self.pushes += 1

    def acked(self, type_url: str, version: str) -> None:
        self.acks.append(version)

    def nacked(self, type_url: str, version: str, detail: str) -> None:
        self.nacks.append((version, detail))


class World:
    def __init__(self, models: list[ModelConfig] = MODELS) -> None:
        self.clock = FakeClock()
        self.store = SnapshotStore(self.clock)
        self.cache = ResourceCache()
        self.builder = ResourceBuilder(models, stale_after=15)
        self.store.update("a", [Endpoint("10.0.0.1", 8000)])
        self.store.update("b", [Endpoint("10.0.0.2", 8000)])
        self.rebuild()

    def rebuild(self) -> None:
        self.cache.set(self.builder.build(self.store.current, self.clock.monotonic()))

    def set_models(self, models: list[ModelConfig]) -> None:
        self.builder = ResourceBuilder(models, 15)
        self.rebuild()

    def version(self, type_url: str, name: str) -> str:
        return self.cache.current.of(type_url)[name].version


def req(
    type_url: str,
    subscribe: Iterable[str] = (),
    unsubscribe: Iterable[str] = (),
    nonce: str = "",
    initial: Mapping[str, str] | None = None,
    error: str | None = None,
) -> discovery_pb2.DeltaDiscoveryRequest:
    r = discovery_pb2.DeltaDiscoveryRequest(
        type_url=type_url, resource_names_subscribe=list(subscribe), resource_names_unsubscribe=list(unsubscribe),
        response_nonce=nonce, initial_resource_versions=dict(initial or {}),
    )
    if error is not None:
        r.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
    return r


def ack(resp: Response) -> discovery_pb2.DeltaDiscoveryRequest:
    return req(resp.type_url, nonce=resp.nonce)


def nack(resp: Response, error: str = "rejected") -> discovery_pb2.DeltaDiscoveryRequest:
    return req(resp.type_url, nonce=resp.nonce, error=error)


def names(resp: Response) -> list[str]:
    return sorted(r.name for r in resp.resources)


def versions(resp: Response) -> dict[str, str]:
    return {r.name: r.version for r in resp.resources}


def assignments(resp: Response) -> dict[str, tuple[Endpoint, ...]]:
    out = {}
    for r in resp.resources:
        cla = endpoint_pb2.ClusterLoadAssignment()
        assert r.resource.Unpack(cla)
        assert cla.cluster_name == r.name
        out[r.name] = endpoints_of(cla)
    return out


def test_wildcard_cds_by_empty_first_request_and_by_star():
    w = World()
    for first in (req(CLUSTER_TYPE), req(CLUSTER_TYPE, ["*"])):
        s = DeltaStream(w.cache)
        [cds] = s.on_request(first)
        assert names(cds) == [A, B]
        # Per-resource versions are the content hashes the cache already has.
        assert versions(cds) == {A: w.version(CLUSTER_TYPE, A), B: w.version(CLUSTER_TYPE, B)}
        assert cds.nonce and cds.system_version_info and not cds.removed_resources
        cluster = cluster_pb2.Cluster()
        assert cds.resources[0].resource.Unpack(cluster)
        assert s.on_request(ack(cds)) == []


def test_named_eds_sends_only_subscribed_then_subscribes_more():
    w = World()
    s = DeltaStream(w.cache)
    [eds] = s.on_request(req(ENDPOINT_TYPE, [A]))
    assert assignments(eds) == {A: (Endpoint("10.0.0.1", 8000),)}
    assert s.on_request(ack(eds)) == []
    [more] = s.on_request(req(ENDPOINT_TYPE, [B]))
    assert names(more) == [B]  # A is held already: not sent again


def test_eds_first_request_without_names_is_not_wildcard():
    w = World()
    s = DeltaStream(w.cache)
    assert s.on_request(req(ENDPOINT_TYPE)) == []


def test_change_sends_only_the_changed_resource_after_the_ack():
    w = World()
    events = Recorder()
    s = DeltaStream(w.cache, events=events)
    [eds] = s.on_request(req(ENDPOINT_TYPE, [A, B]))
    w.store.update("a", [Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.9", 8000)])
    w.rebuild()
    assert s.on_change() == []  # one outstanding response per type
    [push] = s.on_request(ack(eds))
    assert assignments(push) == {A: (Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.9", 8000))}
    assert push.system_version_info != eds.system_version_info
    assert s.on_request(ack(push)) == []
    assert s.on_change() == []  # nothing new
    assert events.acks == [eds.system_version_info, push.system_version_info]


def test_gone_resource_is_removed():
    w = World()
    s = DeltaStream(w.cache)
    [cds] = s.on_request(req(CLUSTER_TYPE))
    [eds] = s.on_request(req(ENDPOINT_TYPE, [A, B]))
    s.on_request(ack(cds))
    s.on_request(ack(eds))
    w.set_models(MODELS[:1])
    pushes = s.on_change()
    assert {p.type_url: (list(p.resources), list(p.removed_resources)) for p in pushes} == {
        CLUSTER_TYPE: ([], [B]),
        ENDPOINT_TYPE: ([], [B]),
    }
    for p in pushes:
        s.on_request(ack(p))
    assert s.on_change() == []  # removed once, not again
    w.set_models(MODELS)
    back = {p.type_url: names(p) for p in s.on_change()}
    assert back == {CLUSTER_TYPE: [B], ENDPOINT_TYPE: [B]}


def test_reconnect_with_initial_versions_resends_only_what_differs():
    w = World()
    s1 = DeltaStream(w.cache)
    [cds] = s1.on_request(req(CLUSTER_TYPE))
    [eds] = s1.on_request(req(ENDPOINT_TYPE, [A, B]))
    held_cds, held_eds = versions(cds), versions(eds)
    # While the client is away: a's endpoints change, model b goes, model c comes.
    w.store.update("a", [Endpoint("10.0.0.5", 8000)])
    w.set_models([MODELS[0], ModelConfig(name="c", endpoints=[])])
    s2 = DeltaStream(w.cache)
    [cds2] = s2.on_request(req(CLUSTER_TYPE, initial=held_cds))
    assert names(cds2) == ["model:c"]  # cluster a's content is unchanged: not resent
    assert list(cds2.removed_resources) == [B]
    [eds2] = s2.on_request(req(ENDPOINT_TYPE, [A, B], initial=held_eds))
    assert assignments(eds2) == {A: (Endpoint("10.0.0.5", 8000),)}
    assert list(eds2.removed_resources) == [B]


def test_reconnect_with_everything_current_sends_nothing_but_the_wildcard_answer():
    w = World()
    [cds] = DeltaStream(w.cache).on_request(req(CLUSTER_TYPE))
    s = DeltaStream(w.cache)
    # An empty answer completes the client's initial fetch of the wildcard type.
    [empty] = s.on_request(req(CLUSTER_TYPE, initial=versions(cds)))
    assert not empty.resources and not empty.removed_resources and empty.nonce
    assert s.on_request(ack(empty)) == []
    assert s.on_request(req(ENDPOINT_TYPE, [A], initial={A: w.version(ENDPOINT_TYPE, A)})) == []


def test_nack_is_counted_keeps_last_good_and_does_not_resend_the_rejected_version():
    w = World()
    events = Recorder()
    s = DeltaStream(w.cache, events=events)
    [eds] = s.on_request(req(ENDPOINT_TYPE, [A, B]))
    s.on_request(ack(eds))
    w.store.update("a", [Endpoint("10.0.0.7", 8000)])
    w.rebuild()
    [bad] = s.on_change()
    assert s.on_request(nack(bad, "bad endpoint")) == []
    assert events.nacks == [(bad.system_version_info, "bad endpoint")]
    assert s.on_change() == []  # same content: no resend loop
    w.store.update("b", [Endpoint("10.0.0.3", 8000)])
    w.rebuild()
    [other] = s.on_change()
    assert names(other) == [B]  # a newer change elsewhere does not drag the rejected version along
    s.on_request(ack(other))
    w.store.update("a", [Endpoint("10.0.0.8", 8000)])
    w.rebuild()
    [fixed] = s.on_change()
    assert assignments(fixed) == {A: (Endpoint("10.0.0.8", 8000),)}
    s.on_request(ack(fixed))
    assert events.pushes == 4


def test_after_a_nack_the_last_good_version_is_sent_again():
    # Envoy may apply part of a NACKed delta response: going back to the last
    # good version must reach it, not be skipped as "already held".
    w = World()
    s = DeltaStream(w.cache)
    [eds] = s.on_request(req(ENDPOINT_TYPE, [A]))
    s.on_request(ack(eds))
    w.store.update("a", [Endpoint("10.0.0.7", 8000)])
    w.rebuild()
    [bad] = s.on_change()
    s.on_request(nack(bad))
    w.store.update("a", [Endpoint("10.0.0.1", 8000)])
    w.rebuild()
    [again] = s.on_change()
    assert versions(again) == versions(eds)


def test_stale_nonce_is_not_an_ack_but_its_subscription_applies():
    w = World()
    events = Recorder()
    s = DeltaStream(w.cache, events=events)
    [first] = s.on_request(req(ENDPOINT_TYPE, [A]))
    assert s.on_request(req(ENDPOINT_TYPE, [B], nonce="not-a-nonce")) == []
    assert events.acks == []  # still waiting for the real ACK
    [more] = s.on_request(ack(first))
    assert names(more) == [B]


def test_unsubscribe_then_resubscribe_resends():
    w = World()
    s = DeltaStream(w.cache)
    [eds] = s.on_request(req(ENDPOINT_TYPE, [A, B]))
    s.on_request(ack(eds))
    assert s.on_request(req(ENDPOINT_TYPE, unsubscribe=[B])) == []  # no removal owed for an unsubscribe
    w.store.update("b", [Endpoint("10.0.0.4", 8000)])
    w.rebuild()
    assert s.on_change() == []  # b is no longer wanted
    [again] = s.on_request(req(ENDPOINT_TYPE, [B]))
    assert assignments(again) == {B: (Endpoint("10.0.0.4", 8000),)}


def test_explicit_resubscribe_of_a_held_resource_resends_it():
    w = World()
    s = DeltaStream(w.cache)
    [eds] = s.on_request(req(ENDPOINT_TYPE, [A]))
    s.on_request(ack(eds))
    [again] = s.on_request(req(ENDPOINT_TYPE, [A]))
    assert versions(again) == versions(eds)


def test_unsubscribe_while_in_flight_is_not_undone_by_the_ack():
    w = World()
    s = DeltaStream(w.cache)
    [eds] = s.on_request(req(ENDPOINT_TYPE, [A, B]))
    s.on_request(req(ENDPOINT_TYPE, unsubscribe=[B]))
    s.on_request(ack(eds))
    [back] = s.on_request(req(ENDPOINT_TYPE, [B]))
    assert names(back) == [B]


def test_unsubscribing_the_wildcard_keeps_explicit_names():
    w = World()
    s = DeltaStream(w.cache)
    [cds] = s.on_request(req(CLUSTER_TYPE, ["*", A]))
    s.on_request(ack(cds))
    assert s.on_request(req(CLUSTER_TYPE, unsubscribe=["*"])) == []
    w.set_models([ModelConfig(name="a", endpoints=[], protocol="http2"), MODELS[1]])
    [push] = s.on_change()
    assert names(push) == [A]


def test_several_clients_each_get_the_change():
    w = World()
    streams = [DeltaStream(w.cache) for _ in range(3)]
    for s in streams:
        [eds] = s.on_request(req(ENDPOINT_TYPE, [B]))
        s.on_request(ack(eds))
    w.store.update("b", [])
    w.rebuild()
    for s in streams:
        [push] = s.on_change()
        assert assignments(push) == {B: ()}


async def test_delta_rpc_over_grpc(tmp_path: Path) -> None:
    data = {"models": [{"name": "m", "endpoints": ["127.0.0.1:9001"]}]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    xds = XdsServer(parse_config(data), XdsOptions(path, port=0, tick_seconds=0.05))
    await xds.start()
    try:
        outgoing: asyncio.Queue[discovery_pb2.DeltaDiscoveryRequest | None] = asyncio.Queue()

        async def requests():
            while (item := await outgoing.get()) is not None:
                yield item

        async with grpc.aio.insecure_channel(f"127.0.0.1:{xds.bound_port}") as channel:
            call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).DeltaAggregatedResources(requests())
            outgoing.put_nowait(req(CLUSTER_TYPE))
            cds = await asyncio.wait_for(call.read(), 5)
            assert names(cds) == ["model:m"]
            outgoing.put_nowait(ack(cds))
            outgoing.put_nowait(req(ENDPOINT_TYPE, ["model:m"]))
            eds = await asyncio.wait_for(call.read(), 5)
            assert assignments(eds) == {"model:m": (Endpoint("127.0.0.1", 9001),)}
            outgoing.put_nowait(ack(eds))
            xds.store.update("m", [Endpoint("127.0.0.1", 9002)])
            push = await asyncio.wait_for(call.read(), 5)
            assert assignments(push) == {"model:m": (Endpoint("127.0.0.1", 9002),)}
            assert xds.servicer.streams == 1
            outgoing.put_nowait(None)
            call.cancel()
        assert xds.registry.get_sample_value("modeldock_xds_pushes_total", {"type": "ClusterLoadAssignment"}) == 2
    finally:
        await xds.stop(0.1)
