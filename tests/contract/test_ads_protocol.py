"""The ADS state machine through a fake stream: no gRPC, no sockets."""

from __future__ import annotations

from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from modeldock.clock import FakeClock
from modeldock.config import ModelConfig
from modeldock.discovery.snapshot import SnapshotStore
from modeldock.types import Endpoint
from modeldock.xds.builder import ResourceBuilder
from modeldock.xds.cache import ResourceCache
from modeldock.xds.protocol import SotwStream, StreamEvents
from modeldock.xds.resources import CLUSTER_TYPE, ENDPOINT_TYPE, endpoints_of

MODELS = [ModelConfig(name="a", endpoints=["10.0.0.1:8000"]), ModelConfig(name="b", endpoints=["10.0.0.2:8000"])]


class Recorder(StreamEvents):
    def __init__(self) -> None:
        self.nacks: list[str] = []
        self.acks: list[str] = []

    def acked(self, type_url: str, version: str) -> None:
        self.acks.append(version)

    def nacked(self, type_url: str, version: str, detail: str) -> None:
        self.nacks.append(version)


class World:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.store = SnapshotStore(self.clock)
        self.cache = ResourceCache()
        self.builder = ResourceBuilder(MODELS, stale_after=15)
        self.store.update("a", [Endpoint("10.0.0.1", 8000)])
        self.store.update("b", [Endpoint("10.0.0.2", 8000)])
        self.rebuild()

    def rebuild(self) -> None:
        self.cache.set(self.builder.build(self.store.current, self.clock.monotonic()))


def req(type_url: str, names: list[str] = (), version: str = "", nonce: str = "", error: str | None = None):
    r = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=list(names), version_info=version,
                                       response_nonce=nonce)
    if error is not None:
        r.error_detail.CopyFrom(status_pb2.Status(code=3, message=error))
    return r


def ack(resp: discovery_pb2.DiscoveryResponse, names: list[str] = ()) -> discovery_pb2.DiscoveryRequest:
    return req(resp.type_url, names, resp.version_info, resp.nonce)


def clusters(resp: discovery_pb2.DiscoveryResponse) -> list[str]:
    out = []
    for any_ in resp.resources:
        c = cluster_pb2.Cluster()
        any_.Unpack(c)
        out.append(c.name)
    return sorted(out)


def assignments(resp: discovery_pb2.DiscoveryResponse) -> dict[str, tuple[Endpoint, ...]]:
    out = {}
    for any_ in resp.resources:
        c = endpoint_pb2.ClusterLoadAssignment()
        any_.Unpack(c)
        out[c.cluster_name] = endpoints_of(c)
    return out


def test_wildcard_cds_then_named_eds_then_ack():
    w = World()
    s = SotwStream(w.cache)
    [cds] = s.on_request(req(CLUSTER_TYPE))
    assert clusters(cds) == ["model:a", "model:b"]
    assert cds.version_info and cds.nonce
    [eds] = s.on_request(req(ENDPOINT_TYPE, ["model:a"]))
    assert assignments(eds) == {"model:a": (Endpoint("10.0.0.1", 8000),)}  # never an unsubscribed resource
    assert s.on_request(ack(cds)) == []
    assert s.on_request(ack(eds, ["model:a"])) == []


def test_change_pushes_only_what_changed_and_waits_for_ack():
    w = World()
    s = SotwStream(w.cache)
    [eds] = s.on_request(req(ENDPOINT_TYPE, ["model:a", "model:b"]))
    assert set(assignments(eds)) == {"model:a", "model:b"}
    w.store.update("a", [Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.9", 8000)])
    w.rebuild()
    assert s.on_change() == []  # first response not yet ACKed
    [push] = s.on_request(ack(eds, ["model:a", "model:b"]))
    assert set(assignments(push)) == {"model:a"}
    assert push.version_info != eds.version_info
    s.on_request(ack(push, ["model:a", "model:b"]))
    assert s.on_change() == []  # nothing new


def test_cds_change_sends_every_cluster():
    w = World()
    s = SotwStream(w.cache)
    [cds] = s.on_request(req(CLUSTER_TYPE))
    s.on_request(ack(cds))
    w.builder = ResourceBuilder([*MODELS, ModelConfig(name="c", endpoints=[])], 15)
    w.rebuild()
    [push] = s.on_change()
    assert clusters(push) == ["model:a", "model:b", "model:c"]


def test_nack_keeps_last_good_and_does_not_resend_rejected_version():
    w = World()
    events = Recorder()
    s = SotwStream(w.cache, events=events)
    [eds] = s.on_request(req(ENDPOINT_TYPE, ["model:a"]))
    s.on_request(ack(eds, ["model:a"]))
    w.store.update("a", [Endpoint("10.0.0.7", 8000)])
    w.rebuild()
    [bad] = s.on_change()
    out = s.on_request(req(ENDPOINT_TYPE, ["model:a"], version=eds.version_info, nonce=bad.nonce, error="rejected"))
    assert out == []
    assert events.nacks == [bad.version_info]
    assert s.on_change() == []  # same content: no resend loop
    w.store.update("a", [Endpoint("10.0.0.8", 8000)])
    w.rebuild()
    [fixed] = s.on_change()
    assert fixed.version_info not in (bad.version_info, eds.version_info)
    assert assignments(fixed)["model:a"] == (Endpoint("10.0.0.8", 8000),)


def test_stale_nonce_is_ignored():
    w = World()
    s = SotwStream(w.cache)
    [first] = s.on_request(req(ENDPOINT_TYPE, ["model:a"]))
    assert s.on_request(req(ENDPOINT_TYPE, ["model:a", "model:b"], nonce="not-a-nonce")) == []
    # The real ACK still works and the subscription change it carries is served.
    [more] = s.on_request(req(ENDPOINT_TYPE, ["model:a", "model:b"], first.version_info, first.nonce))
    assert set(assignments(more)) == {"model:b"}


def test_reconnect_with_known_version_gets_full_state_and_same_version():
    w = World()
    s1 = SotwStream(w.cache)
    [eds] = s1.on_request(req(ENDPOINT_TYPE, ["model:a", "model:b"]))
    s2 = SotwStream(w.cache)  # a new stream after a restart: versions are content hashes
    [again] = s2.on_request(req(ENDPOINT_TYPE, ["model:a", "model:b"], version=eds.version_info))
    assert again.version_info == eds.version_info
    assert set(assignments(again)) == {"model:a", "model:b"}


def test_versions_are_stable_across_server_instances():
    first, second = World().cache.current.versions, World().cache.current.versions
    # Content hashes: present and non-empty for every type served...
    assert set(first) >= {CLUSTER_TYPE, ENDPOINT_TYPE}
    assert all(isinstance(v, str) and v for v in first.values())
    # ...equal for equal content, across instances...
    assert first == second


def test_versions_change_with_content_and_only_for_the_changed_type():
    w = World()
    before = dict(w.cache.current.versions)
    w.store.update("a", [Endpoint("10.0.0.9", 8000)])
    w.rebuild()
    moved = dict(w.cache.current.versions)
    assert moved[ENDPOINT_TYPE] != before[ENDPOINT_TYPE]
    assert moved[CLUSTER_TYPE] == before[CLUSTER_TYPE]
    # Back to the first content: back to the first version (a hash, not a counter).
    w.store.update("a", [Endpoint("10.0.0.1", 8000)])
    w.rebuild()
    assert w.cache.current.versions[ENDPOINT_TYPE] == before[ENDPOINT_TYPE]
    # Another model list: other clusters, another CDS version.
    other = World()
    other.builder = ResourceBuilder([*MODELS, ModelConfig(name="c", endpoints=["10.0.0.3:8000"])], stale_after=15)
    other.rebuild()
    assert other.cache.current.versions[CLUSTER_TYPE] != before[CLUSTER_TYPE]
    assert other.cache.current.versions[CLUSTER_TYPE]


def test_several_clients_each_get_the_change():
    w = World()
    streams = [SotwStream(w.cache) for _ in range(3)]
    for s in streams:
        [eds] = s.on_request(req(ENDPOINT_TYPE, ["model:b"]))
        s.on_request(ack(eds, ["model:b"]))
    w.store.update("b", [])
    w.rebuild()
    for s in streams:
        [push] = s.on_change()
        assert assignments(push) == {"model:b": ()}


def test_unsubscribe_then_resubscribe_resends():
    w = World()
    s = SotwStream(w.cache)
    [eds] = s.on_request(req(ENDPOINT_TYPE, ["model:a", "model:b"]))
    assert s.on_request(ack(eds, ["model:a"])) == []
    out = s.on_request(req(ENDPOINT_TYPE, ["model:a", "model:b"], eds.version_info, ""))
    assert set(assignments(out[0])) == {"model:a", "model:b"}


def test_stale_snapshot_empties_assignments():
    w = World()
    s = SotwStream(w.cache)
    [eds] = s.on_request(req(ENDPOINT_TYPE, ["model:a"]))
    s.on_request(ack(eds, ["model:a"]))
    w.clock.advance(16)
    w.rebuild()
    [push] = s.on_change()
    assert assignments(push) == {"model:a": ()}
    w.store.confirm("a")
    w.rebuild()
    assert w.builder.stale_models(w.store.current, w.clock.monotonic()) == frozenset({"b"})
    [back] = s.on_request(ack(push, ["model:a"]))
    assert assignments(back) == {"model:a": (Endpoint("10.0.0.1", 8000),)}
