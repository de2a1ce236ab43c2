"""Turning the EndpointSlices of one Service into the endpoints of one model.

Pure functions over the official client's models, so they are tested without
a server. The rules follow the EndpointSlice API documentation:

- `conditions.ready` nil means ready ("unknown state ... should be interpreted
  as ready"), so only an explicit `ready: false` excludes an endpoint.
- `conditions.terminating: true` excludes an endpoint even when it is ready
  (a Service with `publishNotReadyAddresses` keeps terminating pods ready).
- The port is matched by name (a string) or by number (an int, or a string of
  digits) against the slice's `ports`, which hold the endpoints' (target)
  ports, not the Service port. A slice without that port contributes nothing.
- IPv4 and IPv6 slices are used; FQDN slices are skipped (not IPs).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kubernetes.client import V1Endpoint, V1EndpointSlice

from modeldock.types import Endpoint

log = logging.getLogger("modeldock.discovery")

IP_ADDRESS_TYPES = ("IPv4", "IPv6")


def slice_port(endpoint_slice: V1EndpointSlice, port: int | str) -> int | None:
    """The slice's port number for `port` (a name or a number), or None."""
    if isinstance(port, str) and port.isdigit():
        port = int(port)  # "8000" from a quoted YAML value: port names always hold a letter
    for entry in endpoint_slice.ports or ():
        if entry.port is None:
            continue  # "ports are not restricted": no number to dial
        if isinstance(port, str) and (entry.name or "") == port:
            return entry.port
        if isinstance(port, int) and entry.port == port:
            return entry.port
    return None


def is_usable(endpoint: V1Endpoint) -> bool:
    conditions = endpoint.conditions
    if conditions is None:
        return True  # every condition unknown: ready, not terminating
    return conditions.ready is not False and conditions.terminating is not True


def slice_endpoints(endpoint_slice: V1EndpointSlice, port: int | str) -> set[Endpoint]:
    if endpoint_slice.address_type not in IP_ADDRESS_TYPES:
        return set()
    number = slice_port(endpoint_slice, port)
    if number is None:
        return set()
    found: set[Endpoint] = set()
    for endpoint in endpoint_slice.endpoints or ():
        if not is_usable(endpoint):
            continue
        for address in endpoint.addresses:
            text = f"[{address}]:{number}" if ":" in address else f"{address}:{number}"
            try:
                found.add(Endpoint.parse(text))
            except ValueError as exc:
                log.debug("skipping an address of EndpointSlice %s: %s", _name(endpoint_slice), exc)
    return found


def merge_endpoints(slices: Iterable[V1EndpointSlice], port: int | str) -> frozenset[Endpoint]:
    """All usable endpoints of a Service: the union over its slices, without duplicates."""
    merged: set[Endpoint] = set()
    for endpoint_slice in slices:
        merged |= slice_endpoints(endpoint_slice, port)
    return frozenset(merged)


def _name(endpoint_slice: V1EndpointSlice) -> str:
    meta = endpoint_slice.metadata
    return f"{meta.namespace}/{meta.name}" if meta else "?"
