"""Turn the endpoint snapshot into the resources served over ADS, incrementally.

A model whose snapshot is older than the cutoff gets an empty
ClusterLoadAssignment (Envoy answers 503) and is listed in the status
resource, so ext_proc answers 503 with a clear message too.

The builder keeps what it built: each model's Cluster (with the ModelConfig it
came from), each model's ClusterLoadAssignment (with the endpoint tuple it
came from), the status resource (with its stale set) and the last
ResourceSet. A build packs only the resources whose inputs changed and derives
the new set from the last one (`ResourceSet.derive`), so a change to one of
1,000 models serialises and hashes one assignment, and a build with no change
returns the last set itself.
"""

from __future__ import annotations

from collections.abc import Iterable

from modeldock.config import ModelConfig
from modeldock.discovery.snapshot import Snapshot
from modeldock.types import Endpoint, cluster_name
from modeldock.xds.cache import Resource, ResourceSet, pack
from modeldock.xds.resources import (
    CLUSTER_TYPE,
    ENDPOINT_TYPE,
    STATUS_NAME,
    STATUS_TYPE,
    build_cluster,
    build_load_assignment,
    build_status,
)


class ResourceBuilder:
    def __init__(self, models: Iterable[ModelConfig], stale_after: float, started_at: float | None = None) -> None:
        self._stale_after = stale_after
        # A model discovery has not reported yet is as old as the server, not infinitely old:
        # it gets the same cutoff to sync before it counts as stale.
        self._started_at = started_at
        self._models: dict[str, ModelConfig] = {}
        self._clusters: dict[str, tuple[ModelConfig, Resource]] = {}  # model -> (its config, its Cluster)
        self._assignments: dict[str, tuple[tuple[Endpoint, ...], Resource]] = {}  # model -> (endpoints, CLA)
        self._status: tuple[frozenset[str], Resource] | None = None
        self._previous: ResourceSet | None = None
        # What set_models changed since the last build: cluster (and assignment) names to put or remove.
        self._cluster_updates: dict[str, Resource] = {}
        self._removed: set[str] = set()
        self.stale: frozenset[str] = frozenset()  # the stale models of the last build
        self.set_models(models)

    @property
    def models(self) -> list[ModelConfig]:
        return list(self._models.values())

    def set_models(self, models: Iterable[ModelConfig]) -> None:
        """Serve these models from the next build: only a model whose config changed gets a new Cluster.

        A model no longer listed loses its Cluster and its assignment.
        """
        new = {m.name: m for m in models}
        for name in self._models.keys() - new.keys():
            del self._clusters[name]
            self._assignments.pop(name, None)
            self._cluster_updates.pop(cluster_name(name), None)
            self._removed.add(cluster_name(name))
        for name, model in new.items():
            held = self._clusters.get(name)
            if held is None or held[0] != model:
                resource = pack(cluster_name(name), build_cluster(model))
                self._clusters[name] = (model, resource)
                self._cluster_updates[resource.name] = resource
                self._removed.discard(resource.name)
        self._models = new

    def age(self, snapshot: Snapshot, model: str, now: float) -> float:
        if model not in snapshot.models and self._started_at is not None:
            return max(0.0, now - self._started_at)
        return snapshot.age(model, now)

    def stale_models(self, snapshot: Snapshot, now: float) -> frozenset[str]:
        limit = self._stale_after
        unreported = self._started_at is None or max(0.0, now - self._started_at) > limit
        entries = snapshot.models
        stale = []
        for name in self._models:
            entry = entries.get(name)
            if unreported if entry is None else max(0.0, now - entry.confirmed_at) > limit:
                stale.append(name)
        return frozenset(stale)

    def build(self, snapshot: Snapshot, now: float) -> ResourceSet:
        stale = self.stale = self.stale_models(snapshot, now)
        entries = snapshot.models
        updates: dict[str, Resource] = {}
        removed: list[str] = []
        for name in self._models:
            entry = entries.get(name)
            held = self._assignments.get(name)
            if name in stale:
                endpoints: tuple[Endpoint, ...] = ()
            elif entry is None:
                # Never listed yet (e.g. just restarted while the API server is down): send
                # nothing, so Envoy and ext_proc keep what they had until the cutoff says stale.
                if held is not None:
                    del self._assignments[name]
                    removed.append(cluster_name(name))
                continue
            else:
                endpoints = entry.endpoints
            # A confirmation keeps the snapshot's tuple: most models are one identity check.
            if held is not None and (held[0] is endpoints or held[0] == endpoints):
                continue
            resource = pack(cluster_name(name), build_load_assignment(name, endpoints))
            self._assignments[name] = (endpoints, resource)
            updates[resource.name] = resource
        if self._status is None or self._status[0] != stale:
            self._status = (stale, pack(STATUS_NAME, build_status(stale)))
        status = {STATUS_NAME: self._status[1]}
        if self._previous is None:
            resources = ResourceSet.build({
                CLUSTER_TYPE: {r.name: r for _, r in self._clusters.values()},
                ENDPOINT_TYPE: {cluster_name(n): self._assignments[n][1] for n in self._models
                                if n in self._assignments},
                STATUS_TYPE: status,
            })
        else:
            gone = sorted(self._removed)
            resources = ResourceSet.derive(
                self._previous,
                {CLUSTER_TYPE: self._cluster_updates, ENDPOINT_TYPE: updates, STATUS_TYPE: status},
                {CLUSTER_TYPE: gone, ENDPOINT_TYPE: [*removed, *gone]},
            )
        self._cluster_updates = {}
        self._removed = set()
        self._previous = resources
        return resources
