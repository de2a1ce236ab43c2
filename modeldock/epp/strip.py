"""The client headers no backend may see: one list for both modes.

modeldock's own bootstrap removes them in Envoy (envoy/bootstrap.yaml, filters
`modeldock.strip_routing_headers` and `modeldock.route_from_metadata`); picker mode removes them in
its header mutation (protocol.py). tests/unit/epp/test_strip.py checks the rendered bootstrap
against these constants, so the two cannot drift apart.
"""

from __future__ import annotations

from modeldock.gateway.request import PRIORITY_HEADER
from modeldock.xds.resources import DESTINATION_HEADER

# Credentials ext_proc reads or does not need, the queue class a tenant asks for (read by the
# director, not the backend's business) and the destination a client must never choose. Picker
# mode overwrites DESTINATION_HEADER rather than remove it (the gateway routes on it), and
# replaces the model's `upstream_auth` header rather than remove it.
STRIPPED_HEADERS: tuple[str, ...] = (
    "authorization", "proxy-authorization", "api-key", "x-api-key", "cookie", PRIORITY_HEADER, DESTINATION_HEADER,
)
# modeldock's own headers (a client could otherwise pick a cluster or forge a request key).
STRIPPED_PREFIXES: tuple[str, ...] = ("x-modeldock-",)
# Removed by the bootstrap only: Envoy's control headers. ext_proc may not mutate `x-envoy-*`
# (Envoy's default mutation rules), and a gateway that treats its clients as external (both
# supported ones do) has its router ignore them: picker mode leaves them to the gateway (docs/mesh.md).
BOOTSTRAP_ONLY_PREFIXES: tuple[str, ...] = ("x-envoy-",)

