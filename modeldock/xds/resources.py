"""Build Envoy resources (Cluster, ClusterLoadAssignment) and the status resource.

Pure functions from config + snapshot to protobuf messages; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2
from envoy.config.core.v3 import address_pb2, config_source_pb2, extension_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.load_balancing_policies.round_robin.v3 import round_robin_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.metadata.v3 import metadata_pb2
from google.protobuf import any_pb2, duration_pb2, struct_pb2, wrappers_pb2

from modeldock.config import ModelConfig
from modeldock.types import Endpoint, cluster_name

CLUSTER_TYPE = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE_TYPE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
# modeldock's own resource: which models the xDS server can no longer vouch for.
# Only modeldock's ext_proc subscribes to it; Envoy never asks for this type.
STATUS_TYPE = "type.googleapis.com/google.protobuf.Struct"
STATUS_NAME = "modeldock.discovery.status"

# The endpoint list's key, under the envoy.lb metadata namespace (the name the
# Gateway API inference extension uses for the same thing).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
# ext_proc's own metadata namespace: the cluster (and a rewritten body's length).
ROUTE_NAMESPACE = "modeldock"


def _typed(name: str, message: object) -> extension_pb2.TypedExtensionConfig:
    packed = any_pb2.Any()
    packed.Pack(message)  # type: ignore[arg-type]
    return extension_pb2.TypedExtensionConfig(name=name, typed_config=packed)


def _load_balancing_policy() -> cluster_pb2.LoadBalancingPolicy:
    # override_host takes ext_proc's primary + fallbacks from the request's dynamic
    # metadata (envoy.lb namespace), one per attempt; round robin is used only once
    # that list is exhausted. No header source: a client could set a header.
    fallback = cluster_pb2.LoadBalancingPolicy(
        policies=[
            cluster_pb2.LoadBalancingPolicy.Policy(
                typed_extension_config=_typed("envoy.load_balancing_policies.round_robin", round_robin_pb2.RoundRobin())
            )
        ]
    )
    override = override_host_pb2.OverrideHost(
        override_host_sources=[
            override_host_pb2.OverrideHost.OverrideHostSource(
                metadata=metadata_pb2.MetadataKey(key=LB_NAMESPACE, path=[
                    metadata_pb2.MetadataKey.PathSegment(key=DESTINATION_HEADER)
                ])
            )
        ],
        fallback_policy=fallback,
    )
    return cluster_pb2.LoadBalancingPolicy(
        policies=[
            cluster_pb2.LoadBalancingPolicy.Policy(
                typed_extension_config=_typed("envoy.load_balancing_policies.override_host", override)
            )
        ]
    )


def stat_name(model: str) -> str:
    """The cluster's name in Envoy's stats. Envoy's Prometheus tag extraction ends the cluster name at
    the first dot, so `model:llama-3.1-8b` would become cluster `model_llama-3` and a metric named
    `..._1_8b_upstream_rq_total`: dots become underscores."""
    return cluster_name(model).replace(".", "_")


def build_cluster(model: ModelConfig) -> cluster_pb2.Cluster:
    cluster = cluster_pb2.Cluster(
        name=cluster_name(model.name),
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=config_source_pb2.ConfigSource(
                ads=config_source_pb2.AggregatedConfigSource(),
                resource_api_version=config_source_pb2.V3,
            )
        ),
        connect_timeout=duration_pb2.Duration(seconds=2),
        load_balancing_policy=_load_balancing_policy(),
        # LLM streams are long: the default of 1024 concurrent requests per cluster
        # would queue users behind generations, not behind real capacity.
        circuit_breakers=circuit_breaker_pb2.CircuitBreakers(
            thresholds=[
                circuit_breaker_pb2.CircuitBreakers.Thresholds(
                    max_connections=wrappers_pb2.UInt32Value(value=100_000),
                    max_pending_requests=wrappers_pb2.UInt32Value(value=100_000),
                    max_requests=wrappers_pb2.UInt32Value(value=100_000),
                    max_retries=wrappers_pb2.UInt32Value(value=1_000),
                )
            ]
        ),
    )
    options = http_protocol_options_pb2.HttpProtocolOptions(
        common_http_protocol_options=protocol_pb2.HttpProtocolOptions(idle_timeout=duration_pb2.Duration(seconds=300)),
    )
    if model.protocol == "http2":
        options.explicit_http_config.http2_protocol_options.CopyFrom(protocol_pb2.Http2ProtocolOptions())
    else:
        options.explicit_http_config.http_protocol_options.CopyFrom(protocol_pb2.Http1ProtocolOptions())
    packed = any_pb2.Any()
    packed.Pack(options)
    cluster.typed_extension_protocol_options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].CopyFrom(packed)
    if "." in model.name:  # only then: other clusters stay byte-identical (and keep their versions)
        cluster.alt_stat_name = stat_name(model.name)
    return cluster


def build_load_assignment(model: str, endpoints: Iterable[Endpoint]) -> endpoint_pb2.ClusterLoadAssignment:
    lb_endpoints = [
        endpoint_components_pb2.LbEndpoint(
            endpoint=endpoint_components_pb2.Endpoint(
                address=address_pb2.Address(
                    socket_address=address_pb2.SocketAddress(address=e.host, port_value=e.port)
                )
            )
        )
        for e in endpoints
    ]
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=cluster_name(model),
        endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=lb_endpoints)] if lb_endpoints else [],
    )


def endpoints_of(assignment: endpoint_pb2.ClusterLoadAssignment) -> tuple[Endpoint, ...]:
    out: list[Endpoint] = []
    for locality in assignment.endpoints:
        for lb in locality.lb_endpoints:
            sock = lb.endpoint.address.socket_address
            out.append(Endpoint(sock.address, sock.port_value))
    return tuple(out)


def build_status(stale_models: Iterable[str]) -> struct_pb2.Struct:
    status = struct_pb2.Struct()
    status.update({"stale_models": sorted(stale_models)})
    return status


def stale_models_of(status: struct_pb2.Struct) -> frozenset[str]:
    value = status.fields.get("stale_models")
    if value is None:
        return frozenset()
    return frozenset(v.string_value for v in value.list_value.values)
