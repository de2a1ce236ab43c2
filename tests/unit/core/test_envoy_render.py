"""The config's `listener:` section as rendered into the Envoy bootstrap.

The behaviour it configures: tests/e2e/test_hardening_envoy.py.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import yaml

from modeldock.cli import main
from modeldock.config import ConfigError, ListenerConfig, parse_config
from modeldock.envoy import USAGE_MARK_HEADER, BootstrapOptions, duration, render_bootstrap

MATCHER_TYPE = "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher"
USAGE_FILTERS = ("modeldock.drop_usage_chunk", "modeldock.usage_from_json", "modeldock.usage_from_sse")


def hcm(config: dict[str, Any]) -> dict[str, Any]:
    typed: dict[str, Any] = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return typed


def inner(typed: dict[str, Any]) -> dict[str, Any]:
    """A filter's own config, through the ExtensionWithMatcher that gates it."""
    if typed["@type"] == MATCHER_TYPE:
        wrapped: dict[str, Any] = typed["extension_config"]["typed_config"]
        return wrapped
    return typed


def render(listener: ListenerConfig) -> dict[str, Any]:
    rendered: dict[str, Any] = yaml.safe_load(render_bootstrap(BootstrapOptions(
        listen_port=1, admin_port=2, xds_port=3, extproc_port=4, listener=listener)))
    return rendered


@pytest.mark.parametrize(("seconds", "text"), [(10, "10s"), (0.5, "0.5s"), (1.25, "1.25s"), (300.0, "300s")])
def test_duration(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_every_listener_field_reaches_the_bootstrap() -> None:
    listener = ListenerConfig(request_headers_timeout_seconds=3, request_timeout_seconds=7.5, idle_timeout_seconds=9,
                              stream_idle_timeout_seconds=11, max_concurrent_streams=13, max_connections=17,
                              max_heap_bytes=19 * 1024 * 1024, ext_proc_message_timeout_seconds=23)
    config = render(listener)
    manager = hcm(config)
    assert (manager["request_headers_timeout"], manager["request_timeout"], manager["stream_idle_timeout"]) == (
        "3s", "7.5s", "11s")
    assert manager["common_http_protocol_options"]["idle_timeout"] == "9s"
    assert manager["http2_protocol_options"]["max_concurrent_streams"] == 13
    ext_proc = next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext_proc["typed_config"]["message_timeout"] == "23s"
    monitors = {m["name"]: m["typed_config"] for m in config["overload_manager"]["resource_monitors"]}
    assert monitors["envoy.resource_monitors.fixed_heap"]["max_heap_size_bytes"] == 19 * 1024 * 1024
    assert monitors["envoy.resource_monitors.global_downstream_max_connections"][
        "max_active_downstream_connections"] == 17
    route = manager["route_config"]["virtual_hosts"][0]["routes"][1]["route"]
    assert route["timeout"] == "0s" and route["idle_timeout"] == "11s"


def test_defaults_are_production_values() -> None:
    manager = hcm(render(ListenerConfig()))
    assert manager["request_timeout"] == "60s" and manager["request_headers_timeout"] == "10s"
    ext_proc = next(f for f in manager["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert ext_proc["typed_config"]["message_timeout"] == "12s"  # the queue's TTL (10 s) + 2 s
    assert ext_proc["typed_config"]["failure_mode_allow"] is True


def test_message_timeout_follows_the_queue_and_is_checked() -> None:
    models = {"models": [{"name": "m", "endpoints": ["127.0.0.1:1"]}]}
    assert parse_config({**models, "queue": {"ttl_seconds": 3}}).listener.ext_proc_message_timeout_seconds == 5
    assert parse_config({**models, "queue": {"enabled": False}}).listener.ext_proc_message_timeout_seconds == 2
    with pytest.raises(ConfigError, match=r"listener\.ext_proc_message_timeout_seconds: 11s must exceed queue"):
        parse_config({**models, "listener": {"ext_proc_message_timeout_seconds": 11}})
    with pytest.raises(ConfigError, match=r"listener\.request_timeout_seconds: 12s must exceed"):
        parse_config({**models, "listener": {"request_timeout_seconds": 12}})
    config = parse_config(
        {**models, "queue": {"ttl_seconds": 30}, "listener": {"ext_proc_message_timeout_seconds": 40}}
    )
    ext_proc = next(
        f for f in hcm(render(config.listener))["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"
    )
    assert ext_proc["typed_config"]["message_timeout"] == "40s"


def test_listener_values_are_validated() -> None:
    with pytest.raises(ConfigError, match="listener.request_timeout_seconds"):
        parse_config({"models": [{"name": "m", "endpoints": ["127.0.0.1:1"]}],
                      "listener": {"request_timeout_seconds": 0}})
    with pytest.raises(ConfigError, match="listener.max_heap_bytes"):
        parse_config({"models": [{"name": "m", "endpoints": ["127.0.0.1:1"]}], "listener": {"max_heap_bytes": 10}})


def test_envoy_config_takes_the_listener_and_body_limit_from_config(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "m", "endpoints": ["127.0.0.1:1"]}],
                                    "limits": {"max_body_bytes": 2048},
                                    "listener": {"request_timeout_seconds": 25}}))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["envoy-config", "--config", str(path)]) == 0
    config = yaml.safe_load(out.getvalue())
    assert hcm(config)["request_timeout"] == "25s"
    assert config["static_resources"]["listeners"][0]["per_connection_buffer_limit_bytes"] == 2048


def test_every_upstream_auth_header_is_set_after_the_client_credential_is_removed_then_forgotten() -> None:
    from modeldock.config import UPSTREAM_AUTH_HEADERS
    from modeldock.extproc.responses import UPSTREAM_AUTH_NAMESPACE

    filters = hcm(render(ListenerConfig()))["http_filters"]
    names = [f["name"] for f in filters]
    ext_proc = filters[names.index("envoy.filters.http.ext_proc")]["typed_config"]
    assert UPSTREAM_AUTH_NAMESPACE in ext_proc["metadata_options"]["receiving_namespaces"]["untyped"]
    mutations = filters[names.index("modeldock.route_from_metadata")]["typed_config"]["mutations"]["request_mutations"]
    removed = mutations.index({"remove": "authorization"})
    sets = {m["append"]["header"]["key"]: (i, m["append"]["header"]["value"])
            for i, m in enumerate(mutations) if "append" in m}
    for header in UPSTREAM_AUTH_HEADERS:
        at, value = sets[header]
        assert at > removed and value == f"%DYNAMIC_METADATA({UPSTREAM_AUTH_NAMESPACE}:{header})%"
    # After the header is set and before the router (and every access log): the value is blanked.
    forget = names.index("modeldock.forget_upstream_auth")
    assert names.index("modeldock.route_from_metadata") < forget < names.index("envoy.filters.http.router")
    (entry,) = filters[forget]["typed_config"]["metadata"]
    assert entry == {"metadata_namespace": UPSTREAM_AUTH_NAMESPACE, "allow_overwrite": True,
                     "value": dict.fromkeys(UPSTREAM_AUTH_HEADERS, "")}


def test_every_budget_response_header_comes_from_the_route_metadata() -> None:
    from modeldock.admission.headers import LIMIT, REMAINING, RESET
    from modeldock.budgets.headers import BUDGET_RESPONSE_HEADERS

    routes = hcm(render(ListenerConfig()))["route_config"]["virtual_hosts"][0]["routes"]
    (routed,) = [r for r in routes if "dynamic_metadata" in r["match"]]
    added = {h["header"]["key"]: h["header"]["value"] for h in routed["response_headers_to_add"]}
    names = (LIMIT, REMAINING, RESET, *BUDGET_RESPONSE_HEADERS)
    # each one, whatever the tuple holds, and the usage mark (test_the_usage_filters_run_only_...)
    assert BUDGET_RESPONSE_HEADERS and set(added) == {*names, USAGE_MARK_HEADER}
    assert all(added[name] == f"%DYNAMIC_METADATA(modeldock:{name})%" for name in names)
    assert "x-ratelimit-binding-tokens" in added and "x-modeldock-output-limit-reason" in added


def test_both_usage_filters_copy_the_counts_and_the_cached_tokens() -> None:
    filters = {f["name"]: inner(f["typed_config"]) for f in hcm(render(ListenerConfig()))["http_filters"]}
    json_rules = filters["modeldock.usage_from_json"]["response_rules"]["rules"]
    sse_rules = [r["rule"] for r in
                 filters["modeldock.usage_from_sse"]["response_rules"]["content_parser"]["typed_config"]["rules"]]
    for rules in (json_rules, sse_rules):
        paths = {r["on_present"]["key"]: [s["key"] for s in r["selectors"]] for r in rules}
        assert paths == {"prompt_tokens": ["usage", "prompt_tokens"],
                         "completion_tokens": ["usage", "completion_tokens"],
                         "cached_tokens": ["usage", "prompt_tokens_details", "cached_tokens"]}
        assert {(r["on_present"]["metadata_namespace"], r["on_present"]["type"]) for r in rules} == {
            ("modeldock.usage", "NUMBER")}


def test_the_drop_usage_filter_runs_after_the_usage_filters_on_the_response() -> None:
    # Responses pass the filters bottom-up: listed before them, Lua sees a chunk after they read it.
    names = [f["name"] for f in hcm(render(ListenerConfig()))["http_filters"]]
    assert names.index("modeldock.drop_usage_chunk") < names.index("modeldock.usage_from_json")
    assert names.index("modeldock.drop_usage_chunk") < names.index("modeldock.usage_from_sse")


def test_the_usage_filters_run_only_for_a_request_marked_for_usage() -> None:
    # Without a budget or usage records (most tenants), none of the three filters may touch a response:
    # each is wrapped in a matcher that skips it unless the response carries the mark the route adds.
    manager = hcm(render(ListenerConfig()))
    filters = {f["name"]: f["typed_config"] for f in manager["http_filters"]}
    skip = {"name": "skip", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.common.matcher.action.v3.SkipFilter"}}
    for name in USAGE_FILTERS:
        typed = filters[name]
        assert typed["@type"] == MATCHER_TYPE and typed["extension_config"]["name"] == name
        (rule,) = typed["xds_matcher"]["matcher_list"]["matchers"]
        assert rule["on_match"] == {"action": skip}
        marked = rule["predicate"]["not_matcher"]["single_predicate"]
        assert marked["input"]["typed_config"] == {
            "@type": "type.googleapis.com/envoy.type.matcher.v3.HttpResponseHeaderMatchInput",
            "header_name": USAGE_MARK_HEADER}
        assert marked["value_match"] == {"exact": "1"}  # what extproc/responses.py writes into modeldock:usage
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    (routed,) = [r for r in routes if "dynamic_metadata" in r["match"]]
    added = {h["header"]["key"]: h["header"]["value"] for h in routed["response_headers_to_add"]}
    assert added[USAGE_MARK_HEADER] == "%DYNAMIC_METADATA(modeldock:usage)%"
    # A backend cannot switch the filters on (removes come before adds), and the client never sees the mark.
    assert USAGE_MARK_HEADER in routed["response_headers_to_remove"]
    assert all(USAGE_MARK_HEADER not in {h["header"]["key"] for h in r.get("response_headers_to_add", [])}
               for r in routes if r is not routed)
    strip = filters["modeldock.strip_routing_headers"]["mutations"]["response_mutations"]
    assert {"remove": USAGE_MARK_HEADER} in strip
