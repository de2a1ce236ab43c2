"""One list of the client headers no backend sees: the bootstrap strips exactly modeldock/epp/strip.py's
(and Envoy's x-envoy-*), and picker mode removes every one of them."""

from __future__ import annotations

from typing import Any

import yaml

from modeldock.envoy import BootstrapOptions, render_bootstrap
from modeldock.epp import protocol
from modeldock.epp.strip import BOOTSTRAP_ONLY_PREFIXES, STRIPPED_HEADERS, STRIPPED_PREFIXES
from modeldock.xds.resources import DESTINATION_HEADER

# The two request-side header filters of the bootstrap that remove client headers (envoy/bootstrap.yaml).
STRIP_FILTERS = ("modeldock.strip_routing_headers", "modeldock.route_from_metadata")


def bootstrap_stripped() -> tuple[set[str], set[str]]:
    """(headers removed by name, prefixes removed) by the rendered bootstrap's header filters."""
    rendered = yaml.safe_load(render_bootstrap(BootstrapOptions(10000, 10001, 10002, 10003)))
    listener = rendered["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    filters = {f["name"]: f for f in hcm["http_filters"]}
    names: set[str] = set()
    prefixes: set[str] = set()
    for name in STRIP_FILTERS:
        mutations: list[dict[str, Any]] = filters[name]["typed_config"]["mutations"]["request_mutations"]
        for mutation in mutations:
            if "remove" in mutation:
                names.add(mutation["remove"])
            elif "remove_on_match" in mutation:
                prefixes.add(mutation["remove_on_match"]["key_matcher"]["prefix"])
    return names, prefixes


def test_the_bootstrap_strips_exactly_the_shared_list_and_x_envoy() -> None:
    names, prefixes = bootstrap_stripped()
    assert names == set(STRIPPED_HEADERS)
    assert prefixes == set(STRIPPED_PREFIXES) | set(BOOTSTRAP_ONLY_PREFIXES) == {"x-modeldock-", "x-envoy-"}


def test_picker_mode_removes_the_same_list_and_overwrites_the_destination() -> None:
    response = protocol.routed_headers("10.0.0.1:8000", 2, ["x-modeldock-cluster", "x-envoy-retry-on"], None)
    mutation = response.request_headers.response.header_mutation
    removed = set(mutation.remove_headers)
    assert set(STRIPPED_HEADERS) - {DESTINATION_HEADER} <= removed and "x-modeldock-cluster" in removed
    assert "x-envoy-retry-on" not in removed  # the gateway's: ext_proc may not mutate x-envoy-*
    destination = [h.header.raw_value for h in mutation.set_headers if h.header.key == DESTINATION_HEADER]
    assert destination == [b"10.0.0.1:8000"]
