"""Incremental xDS (modeldock/xds/builder.py, cache.py, delta.py): a change to one of many models packs,
hashes and sends that model's resources only, and what is built and sent is exactly what a full build
and a full comparison give."""

from __future__ import annotations

import random

import pytest
from envoy.service.discovery.v3 import discovery_pb2
from google.rpc import status_pb2

from modeldock.clock import FakeClock
from modeldock.config import ModelConfig
from modeldock.discovery.snapshot import SnapshotStore
from modeldock.types import Endpoint
from modeldock.xds.builder import ResourceBuilder
from modeldock.xds.cache import ResourceCache, ResourceSet
from modeldock.xds.delta import DeltaStream
from modeldock.xds.resources import CLUSTER_TYPE, ENDPOINT_TYPE, STATUS_TYPE

pytestmark = pytest.mark.timeout(60)


def model(i: int) -> ModelConfig:
    return ModelConfig(name=f"m{i:04d}", endpoints=[f"10.0.{i // 250}.{i % 250 + 1}:8000"])


def eps(i: int, n: int, gen: int = 0) -> list[Endpoint]:
    return [Endpoint(f"10.{gen % 200}.{i // 250}.{i % 250 + 1}", 8000 + k) for k in range(n)]


class World:
    def __init__(self, models: int, history: int = 256) -> None:
        self.clock = FakeClock()
        self.store = SnapshotStore(self.clock)
        self.models = [model(i) for i in range(models)]
        self.builder = ResourceBuilder(self.models, stale_after=15, started_at=self.clock.monotonic())
        for i in range(models):
            self.store.update(f"m{i:04d}", eps(i, 2))
        self.cache = ResourceCache(history=history)
        self.rebuild()

    def rebuild(self) -> ResourceSet:
        resources = self.builder.build(self.store.current, self.clock.monotonic())
        self.cache.set(resources)
        return resources

    def full(self) -> ResourceSet:
        """What a builder that never saw the earlier snapshots builds."""
        fresh = ResourceBuilder(self.builder.models, stale_after=15, started_at=self.clock.monotonic())
        return fresh.build(self.store.current, self.clock.monotonic())


def same_content(a: ResourceSet, b: ResourceSet) -> None:
    assert set(a.by_type) == set(b.by_type)
    for type_url in a.by_type:
        assert {n: r.version for n, r in a.of(type_url).items()} == {n: r.version for n, r in b.of(type_url).items()}
    assert dict(a.versions) == dict(b.versions)


def test_a_change_to_one_of_a_thousand_models_packs_only_its_assignment() -> None:
    world = World(1000)
    before = world.cache.current
    world.store.update("m0007", eps(7, 3, gen=1))
    after = world.rebuild()
    changed = [n for n, r in after.of(ENDPOINT_TYPE).items() if r is not before.of(ENDPOINT_TYPE)[n]]
    assert changed == ["model:m0007"]  # every other Resource is the same object, its bytes not packed again
    assert after.of(CLUSTER_TYPE) is before.of(CLUSTER_TYPE)  # no Cluster changed: the same mapping
    assert after.versions[CLUSTER_TYPE] == before.versions[CLUSTER_TYPE]
    assert after.versions[ENDPOINT_TYPE] != before.versions[ENDPOINT_TYPE]
    assert dict(after.changed) == {ENDPOINT_TYPE: frozenset({"model:m0007"})}
    same_content(after, world.full())  # versions equal a build from scratch: same on every replica


def test_a_build_with_nothing_changed_is_the_last_set_itself() -> None:
    world = World(50)
    first = world.cache.current
    world.clock.advance(1)
    world.store.confirm("m0003")  # confirmed: newer, same endpoints
    assert world.rebuild() is first
    assert not world.cache.set(first)


def test_stale_models_go_empty_then_come_back_and_the_status_follows() -> None:
    world = World(20)
    world.clock.advance(10)
    world.store.confirm_many([f"m{i:04d}" for i in range(1, 20)])  # all but m0000
    world.clock.advance(6)
    stale = world.rebuild()
    assert world.builder.stale == {"m0000"}
    assert stale.changed[ENDPOINT_TYPE] == {"model:m0000"} and STATUS_TYPE in stale.changed
    same_content(stale, world.full())
    world.store.update("m0000", eps(0, 2))
    back = world.rebuild()
    assert world.builder.stale == frozenset()
    same_content(back, world.full())


def test_models_added_and_removed_change_their_cluster_and_assignment_only() -> None:
    world = World(30)
    before = world.cache.current
    kept = [m for m in world.models if m.name != "m0004"]
    added = ModelConfig(name="m9999", endpoints=["10.9.9.9:8000"])
    world.builder.set_models([*kept, added])
    world.store.update("m9999", [Endpoint("10.9.9.9", 8000)])
    after = world.rebuild()
    assert after.changed[CLUSTER_TYPE] == {"model:m0004", "model:m9999"}
    assert after.changed[ENDPOINT_TYPE] == {"model:m0004", "model:m9999"}
    assert "model:m0004" not in after.of(CLUSTER_TYPE) and "model:m0004" not in after.of(ENDPOINT_TYPE)
    assert all(after.of(CLUSTER_TYPE)[n] is r for n, r in before.of(CLUSTER_TYPE).items() if n != "model:m0004")
    same_content(after, world.full())


def test_the_cache_says_what_changed_since_a_set_and_admits_when_it_cannot() -> None:
    world = World(10, history=3)
    start = world.cache.current.serial
    assert world.cache.changed_since(ENDPOINT_TYPE, start) == frozenset()
    for k, i in enumerate((1, 2)):
        world.store.update(f"m{i:04d}", eps(i, 1, gen=k + 1))
        world.rebuild()
    assert world.cache.changed_since(ENDPOINT_TYPE, start) == {"model:m0001", "model:m0002"}
    assert world.cache.changed_since(CLUSTER_TYPE, start) == frozenset()
    for k in range(3):
        world.store.update("m0005", eps(5, 1, gen=k + 10))
        world.rebuild()
    assert world.cache.changed_since(ENDPOINT_TYPE, start) is None  # older than the log
    # A set not derived from the current one (another builder's) leaves nothing known before it.
    middle = world.cache.current.serial
    assert not world.cache.set(world.full())  # the same content is no change, derived or not
    world.store.update("m0006", eps(6, 1, gen=20))
    assert world.cache.set(world.full())
    assert world.cache.current.serial != middle and world.cache.changed_since(ENDPOINT_TYPE, middle) is None


# -- the delta stream: incremental comparison against a full one ----------------------------------


def _request(type_url: str, subscribe: list[str] = [], unsubscribe: list[str] = [],  # noqa: B006
             nonce: str = "", error: bool = False) -> discovery_pb2.DeltaDiscoveryRequest:
    r = discovery_pb2.DeltaDiscoveryRequest(type_url=type_url, resource_names_subscribe=subscribe,
                                            resource_names_unsubscribe=unsubscribe, response_nonce=nonce)
    if error:
        r.error_detail.CopyFrom(status_pb2.Status(code=3, message="rejected"))
    return r


def _shape(responses: list[discovery_pb2.DeltaDiscoveryResponse]) -> list[tuple[object, ...]]:
    return [(r.type_url, r.system_version_info, sorted((x.name, x.version) for x in r.resources),
             sorted(r.removed_resources)) for r in responses]


@pytest.mark.parametrize("seed", range(12))
def test_incremental_delta_sends_exactly_what_a_full_comparison_sends(seed: int) -> None:
    rng = random.Random(seed)
    incremental, full = World(40), World(40, history=0)  # history 0: every comparison is a full one
    streams = [DeltaStream(incremental.cache), DeltaStream(full.cache)]
    pending: dict[str, str] = {}
    names = [f"model:m{i:04d}" for i in range(40)]

    def both(request: discovery_pb2.DeltaDiscoveryRequest | None) -> None:
        got = [s.on_request(request) if request is not None else s.on_change() for s in streams]
        assert _shape(got[0]) == _shape(got[1])
        for response in got[0]:
            pending[response.type_url] = response.nonce

    both(_request(CLUSTER_TYPE))
    both(_request(ENDPOINT_TYPE, rng.sample(names, 10)))
    for step in range(80):
        op = rng.random()
        if op < 0.45:  # the snapshot changes: a model's endpoints, or a model leaves or joins
            i, count = rng.randrange(40), rng.randrange(0, 3)
            for world in (incremental, full):
                world.store.update(f"m{i:04d}", eps(i, count, gen=step))
            rng_state = rng.getstate()
            for world in (incremental, full):
                rng.setstate(rng_state)
                if rng.random() < 0.1:
                    world.builder.set_models(rng.sample(world.models, 35))
                world.rebuild()
            both(None)
        elif op < 0.75 and pending:  # the client answers the outstanding response
            type_url = rng.choice(sorted(pending))
            both(_request(type_url, nonce=pending.pop(type_url), error=rng.random() < 0.2))
        elif op < 0.85:
            both(_request(ENDPOINT_TYPE, subscribe=rng.sample(names, 3)))
        elif op < 0.95:
            both(_request(ENDPOINT_TYPE, unsubscribe=rng.sample(names, 3)))
        else:  # names dropped from a wildcard subscription are still wanted: the client may lack them
            both(_request(CLUSTER_TYPE, unsubscribe=rng.sample(names, 2)))
