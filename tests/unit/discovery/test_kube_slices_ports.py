"""A slice whose port list holds an entry without a number ("ports are not restricted") before the
wanted one: the entry is skipped, the search goes on."""

from __future__ import annotations

import logging

import pytest
from kubernetes.client import V1EndpointSlice

from modeldock.discovery.kube_slices import slice_endpoints, slice_port
from modeldock.types import Endpoint
from tests.support.fake_kube import make_slice


def slice_with_unrestricted_entry_first() -> V1EndpointSlice:
    obj = make_slice("s1", "llm", "vllm", [("10.0.0.1", True, False)], "http", 8000)
    obj["ports"].insert(0, {"name": "any", "protocol": "TCP"})  # no port number
    parsed = V1EndpointSlice.from_dict(obj)
    assert parsed is not None and parsed.ports[0].port is None
    return parsed


def test_entry_without_a_number_is_skipped_and_the_search_goes_on() -> None:
    endpoint_slice = slice_with_unrestricted_entry_first()
    assert slice_port(endpoint_slice, "http") == 8000
    assert slice_port(endpoint_slice, 8000) == 8000
    assert slice_port(endpoint_slice, "any") is None  # named, but nothing to dial
    assert slice_endpoints(endpoint_slice, "http") == {Endpoint("10.0.0.1", 8000)}


def test_an_address_that_is_not_an_ip_is_skipped_and_logged_with_its_slice(caplog: pytest.LogCaptureFixture) -> None:
    obj = make_slice("s1", "llm", "vllm", [("10.0.0.1", True, False), ("10.0.0.2", True, False)], "http", 8000)
    obj["endpoints"][0]["addresses"] = ["not-an-ip"]
    endpoint_slice = V1EndpointSlice.from_dict(obj)
    with caplog.at_level(logging.DEBUG, logger="modeldock.discovery"):
        assert slice_endpoints(endpoint_slice, "http") == {Endpoint("10.0.0.2", 8000)}
    [line] = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert line.startswith("skipping an address of EndpointSlice llm/s1: ") and "not-an-ip" in line
