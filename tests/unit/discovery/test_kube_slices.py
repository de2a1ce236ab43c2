"""EndpointSlice -> endpoints rules, on the official client's models."""

from __future__ import annotations

from typing import Any

from kubernetes.client import V1EndpointSlice

from modeldock.discovery.kube_slices import merge_endpoints, slice_endpoints
from modeldock.types import Endpoint
from tests.support.fake_kube import make_slice, validate


def model(obj: dict[str, Any]) -> V1EndpointSlice:
    validate(obj)
    parsed = V1EndpointSlice.from_dict(obj)
    assert parsed is not None
    return parsed


def one(addresses: list[tuple[str, bool | None, bool | None]], **kwargs: Any) -> V1EndpointSlice:
    args: dict[str, Any] = {"port_name": "http", "port": 8000} | kwargs
    return model(make_slice("s1", "llm", "vllm", addresses, **args))


def test_ready_true_and_unknown_are_used_false_is_not() -> None:
    found = slice_endpoints(
        one([("10.0.0.1", True, False), ("10.0.0.2", None, None), ("10.0.0.3", False, False)]), "http"
    )
    assert found == {Endpoint("10.0.0.1", 8000), Endpoint("10.0.0.2", 8000)}


def test_terminating_is_excluded_even_when_ready() -> None:
    # publishNotReadyAddresses keeps terminating pods `ready`; we still drain them.
    found = slice_endpoints(one([("10.0.0.1", True, True), ("10.0.0.2", True, None)]), "http")
    assert found == {Endpoint("10.0.0.2", 8000)}


def test_no_conditions_at_all_means_ready() -> None:
    obj = make_slice("s1", "llm", "vllm", [("10.0.0.1", None, None)], "http", 8000)
    del obj["endpoints"][0]["conditions"]
    assert slice_endpoints(model(obj), "http") == {Endpoint("10.0.0.1", 8000)}


def test_port_by_name_uses_the_slice_number() -> None:
    endpoint_slice = one([("10.0.0.1", True, False)], port_name="http", port=8123)
    assert slice_endpoints(endpoint_slice, "http") == {Endpoint("10.0.0.1", 8123)}
    assert slice_endpoints(endpoint_slice, "grpc") == set()


def test_port_by_number() -> None:
    endpoint_slice = one([("10.0.0.1", True, False)], port_name="http", port=8123)
    assert slice_endpoints(endpoint_slice, 8123) == {Endpoint("10.0.0.1", 8123)}
    assert slice_endpoints(endpoint_slice, "8123") == {Endpoint("10.0.0.1", 8123)}
    assert slice_endpoints(endpoint_slice, 8000) == set()


def test_unnamed_port_matches_the_empty_name_and_its_number() -> None:
    endpoint_slice = one([("10.0.0.1", True, False)], port_name=None, port=9000)
    assert slice_endpoints(endpoint_slice, 9000) == {Endpoint("10.0.0.1", 9000)}
    assert slice_endpoints(endpoint_slice, "http") == set()


def test_slice_without_ports_contributes_nothing() -> None:
    assert slice_endpoints(one([("10.0.0.1", True, False)], port=None), "http") == set()


def test_second_port_of_a_slice() -> None:
    obj = make_slice("s1", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000)
    obj["ports"].append({"name": "metrics", "port": 9090, "protocol": "TCP"})
    assert slice_endpoints(model(obj), "metrics") == {Endpoint("10.0.0.1", 9090)}
    assert slice_endpoints(model(obj), 8000) == {Endpoint("10.0.0.1", 8000)}


def test_ipv6_is_normalised() -> None:
    endpoint_slice = one([("fd00:0:0:0::5", True, False)], address_type="IPv6")
    (found,) = slice_endpoints(endpoint_slice, "http")
    assert found == Endpoint("fd00::5", 8000)
    assert found.address == "[fd00::5]:8000"


def test_fqdn_slices_are_skipped() -> None:
    endpoint_slice = one([("vllm-0.example.com", True, False)], address_type="FQDN")
    assert slice_endpoints(endpoint_slice, "http") == set()


def test_merge_deduplicates_across_slices() -> None:
    first = model(make_slice("s1", "llm", "vllm", [("10.0.0.1", True, False), ("10.0.0.2", True, False)], "http", 8000))
    second = model(make_slice("s2", "llm", "vllm", [("10.0.0.2", True, False), ("10.0.0.3", None, None)], "http", 8000))
    assert merge_endpoints([first, second], "http") == {
        Endpoint("10.0.0.1", 8000),
        Endpoint("10.0.0.2", 8000),
        Endpoint("10.0.0.3", 8000),
    }


def test_merge_keeps_an_address_ready_in_another_slice() -> None:
    # The same pod can sit in two slices while the controller moves it.
    first = model(make_slice("s1", "llm", "vllm", [("10.0.0.1", False, False)], "http", 8000))
    second = model(make_slice("s2", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000))
    assert merge_endpoints([first, second], "http") == {Endpoint("10.0.0.1", 8000)}
