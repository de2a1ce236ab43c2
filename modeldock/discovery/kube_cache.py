"""The local cache of one namespace's EndpointSlices, indexed by Service.

Pure (no I/O, no threads), so it is tested without a server. It keeps only
the slices of Services some model names, and of each only its endpoints per
port the models ask for (`kube_slices.slice_endpoints`), not the client's
model objects: memory grows with those Services' endpoints, not with the
namespace's Services or with the models.

A slice belongs to the Service in its `kubernetes.io/service-name` label. A
slice whose label changes moves (a MODIFIED event under the new name); a slice
that leaves the watch's selector arrives as DELETED.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kubernetes.client import V1EndpointSlice

from modeldock.discovery.kube_slices import slice_endpoints
from modeldock.types import Endpoint

log = logging.getLogger("modeldock.discovery")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"

Port = int | str  # a port name or number, as the config gives it
Target = tuple[str, Port]  # (model name, port)
Found = dict[str, frozenset[Endpoint]]  # model -> its endpoints now
SliceEndpoints = dict[Port, frozenset[Endpoint]]  # one slice's endpoints, per port asked for


@dataclass(frozen=True)
class CacheSize:
    services: int  # Services with at least one slice cached
    slices: int
    endpoints: int  # summed over slices and ports: what the cache holds


class NamespaceIndex:
    """(service -> slice name -> endpoints per port) for one namespace, plus the models it feeds."""

    def __init__(self, namespace: str, targets: Mapping[str, Iterable[Target]]) -> None:
        self.namespace = namespace
        self._targets: dict[str, tuple[Target, ...]] = {service: tuple(t) for service, t in targets.items()}
        self._ports: dict[str, frozenset[Port]] = {s: frozenset(p for _, p in t) for s, t in self._targets.items()}
        self.models = frozenset(model for targets in self._targets.values() for model, _ in targets)
        self._slices: dict[str, dict[str, SliceEndpoints]] = {}
        self._owner: dict[str, str] = {}  # slice name -> the Service it is cached under

    @property
    def services(self) -> list[str]:
        return sorted(self._targets)

    def size(self) -> CacheSize:
        slices = [entry for by_name in self._slices.values() for entry in by_name.values()]
        return CacheSize(len(self._slices), len(slices), sum(len(e) for entry in slices for e in entry.values()))

    def replace(self, items: Iterable[V1EndpointSlice]) -> Found:
        """A full list: the cache becomes exactly these slices; every model's endpoints."""
        self._slices.clear()
        self._owner.clear()
        for item in items:
            self._put(item)
        return self._found(self._targets)

    def apply(self, kind: str, obj: object) -> Found | None:
        """One watch event; the endpoints of the models of the Services it touched.

        {} when it touched no Service a model names (a bookmark, another
        Service's slice); None for an event type we do not know.
        """
        if kind == "BOOKMARK":
            return {}
        if kind not in ("ADDED", "MODIFIED", "DELETED") or not isinstance(obj, V1EndpointSlice):
            log.debug("ignoring watch event %r in namespace %s", kind, self.namespace)
            return None
        name = slice_name(obj)
        touched = {self._owner[name]} if name in self._owner else set()
        self._drop(name)
        if kind != "DELETED":
            touched |= self._put(obj)
        return self._found(touched)

    def _put(self, item: V1EndpointSlice) -> set[str]:
        service = service_of(item)
        ports = self._ports.get(service)
        if ports is None:
            return set()  # no model names this Service: nothing kept
        name = slice_name(item)
        self._slices.setdefault(service, {})[name] = {port: frozenset(slice_endpoints(item, port)) for port in ports}
        self._owner[name] = service
        return {service}

    def _drop(self, name: str) -> None:
        service = self._owner.pop(name, None)
        if service is None:
            return
        by_name = self._slices[service]
        del by_name[name]
        if not by_name:
            del self._slices[service]  # a Service with no slices costs nothing

    def _found(self, services: Iterable[str]) -> Found:
        found: Found = {}
        for service in services:
            by_name = self._slices.get(service, {})
            for model, port in self._targets[service]:
                merged: set[Endpoint] = set()
                for entry in by_name.values():
                    merged |= entry[port]
                found[model] = frozenset(merged)
        return found


def service_of(endpoint_slice: V1EndpointSlice) -> str:
    meta = endpoint_slice.metadata
    labels = (meta.labels if meta else None) or {}
    return str(labels.get(SERVICE_NAME_LABEL, ""))


def slice_name(endpoint_slice: V1EndpointSlice) -> str:
    meta = endpoint_slice.metadata
    return (meta.name if meta else None) or ""
