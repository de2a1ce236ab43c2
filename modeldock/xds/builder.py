"""Turn the endpoint snapshot into the resources served over ADS.

A model whose snapshot is older than the cutoff gets an empty
ClusterLoadAssignment (Envoy answers 503) and is listed in the status
resource, so ext_proc answers 503 with a clear message too.
"""

from __future__ import annotations

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
    def __init__(self, models: list[ModelConfig], stale_after: float, started_at: float | None = None) -> None:
        self._models = list(models)
        self._stale_after = stale_after
        # A model discovery has not reported yet is as old as the server, not infinitely old:
        # it gets the same cutoff to sync before it counts as stale.
        self._started_at = started_at
        self._clusters = {cluster_name(m.name): pack(cluster_name(m.name), build_cluster(m)) for m in models}
        # Rebuilding 10k endpoints on every change is wasteful; most models do not change.
        self._assignments: dict[str, tuple[tuple[Endpoint, ...], Resource]] = {}

    def age(self, snapshot: Snapshot, model: str, now: float) -> float:
        if model not in snapshot.models and self._started_at is not None:
            return max(0.0, now - self._started_at)
        return snapshot.age(model, now)

    def stale_models(self, snapshot: Snapshot, now: float) -> frozenset[str]:
        return frozenset(m.name for m in self._models if self.age(snapshot, m.name, now) > self._stale_after)

    def build(self, snapshot: Snapshot, now: float) -> ResourceSet:
        stale = self.stale_models(snapshot, now)
        assignments: dict[str, Resource] = {}
        for model in self._models:
            if model.name not in stale and model.name not in snapshot.models:
                # Never listed yet (e.g. just restarted while the API server is down): send
                # nothing, so Envoy and ext_proc keep what they had until the cutoff says stale.
                continue
            endpoints = () if model.name in stale else snapshot.endpoints(model.name)
            cached = self._assignments.get(model.name)
            if cached is None or cached[0] != endpoints:
                name = cluster_name(model.name)
                cached = (endpoints, pack(name, build_load_assignment(model.name, endpoints)))
                self._assignments[model.name] = cached
            assignments[cluster_name(model.name)] = cached[1]
        status = {STATUS_NAME: pack(STATUS_NAME, build_status(stale))}
        return ResourceSet.build({CLUSTER_TYPE: self._clusters, ENDPOINT_TYPE: assignments, STATUS_TYPE: status})
