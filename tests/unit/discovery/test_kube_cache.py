"""The namespace cache, indexed by Service: what each list and event gives which model."""

from __future__ import annotations

from typing import Any

from kubernetes.client import V1EndpointSlice

from modeldock.discovery.kube_cache import CacheSize, NamespaceIndex
from modeldock.types import Endpoint
from tests.support.fake_kube import make_slice, validate


def sl(name: str, service: str, *ips: str, port: int = 8000, **kwargs: Any) -> V1EndpointSlice:
    obj = make_slice(name, "llm", service, [(ip, True, False) for ip in ips], "http", port, **kwargs)
    validate(obj)
    parsed = V1EndpointSlice.from_dict(obj)
    assert parsed is not None
    return parsed


def eps(*addresses: str) -> frozenset[Endpoint]:
    return frozenset(Endpoint.parse(a) for a in addresses)


def index() -> NamespaceIndex:
    return NamespaceIndex("llm", {"vllm": [("a", "http"), ("a-metrics", 9090)], "other": [("b", "http")]})


def test_a_list_gives_every_model_even_without_slices() -> None:
    idx = index()
    found = idx.replace([sl("vllm-1", "vllm", "10.0.0.1"), sl("vllm-2", "vllm", "10.0.0.2")])
    assert found == {"a": eps("10.0.0.1:8000", "10.0.0.2:8000"), "a-metrics": eps(), "b": eps()}
    assert idx.models == {"a", "a-metrics", "b"}
    assert idx.services == ["other", "vllm"]


def test_an_event_gives_only_the_models_of_the_service_it_touched() -> None:
    idx = index()
    idx.replace([sl("vllm-1", "vllm", "10.0.0.1"), sl("other-1", "other", "10.0.1.1")])
    assert idx.apply("ADDED", sl("vllm-2", "vllm", "10.0.0.2")) == {
        "a": eps("10.0.0.1:8000", "10.0.0.2:8000"),
        "a-metrics": eps(),
    }
    assert idx.apply("MODIFIED", sl("other-1", "other", "10.0.1.9")) == {"b": eps("10.0.1.9:8000")}
    assert idx.apply("DELETED", sl("vllm-1", "vllm", "10.0.0.1")) == {"a": eps("10.0.0.2:8000"), "a-metrics": eps()}
    assert idx.apply("BOOKMARK", {"metadata": {"resourceVersion": "7"}}) == {}
    assert idx.apply("SOMETHING-NEW", sl("vllm-2", "vllm")) is None


def test_a_slice_that_changes_service_moves_and_both_are_recomputed() -> None:
    idx = index()
    idx.replace([sl("s", "vllm", "10.0.0.1")])
    assert idx.apply("MODIFIED", sl("s", "other", "10.0.0.1")) == {
        "a": eps(),
        "a-metrics": eps(),
        "b": eps("10.0.0.1:8000"),
    }
    # To a Service no model names: it leaves the cache.
    assert idx.apply("MODIFIED", sl("s", "unrelated", "10.0.0.1")) == {"b": eps()}
    assert idx.size() == CacheSize(services=0, slices=0, endpoints=0)


def test_slices_of_services_no_model_names_are_not_kept() -> None:
    idx = index()
    found = idx.replace([sl(f"x-{i}", f"unrelated-{i}", f"10.1.0.{i}") for i in range(50)])
    assert found == {"a": eps(), "a-metrics": eps(), "b": eps()}
    assert idx.apply("ADDED", sl("x-99", "unrelated-99", "10.1.1.1")) == {}
    assert idx.apply("DELETED", sl("x-3", "unrelated-3", "10.1.0.3")) == {}
    assert idx.size() == CacheSize(services=0, slices=0, endpoints=0)


def test_the_cache_holds_endpoints_and_forgets_a_service_whose_slices_are_gone() -> None:
    idx = index()
    idx.replace([sl("vllm-1", "vllm", "10.0.0.1", "10.0.0.2"), sl("other-1", "other", "10.0.1.1")])
    # Per slice, one set per port the models ask for: vllm-1 holds 2 for `http` and 0 for 9090.
    assert idx.size() == CacheSize(services=2, slices=2, endpoints=3)
    idx.apply("DELETED", sl("other-1", "other"))
    assert idx.size() == CacheSize(services=1, slices=1, endpoints=2)


def test_a_list_replaces_everything_cached_before() -> None:
    idx = index()
    idx.replace([sl("vllm-1", "vllm", "10.0.0.1"), sl("other-1", "other", "10.0.1.1")])
    assert idx.replace([sl("vllm-2", "vllm", "10.0.0.2")]) == {
        "a": eps("10.0.0.2:8000"),
        "a-metrics": eps(),
        "b": eps(),
    }
    # The forgotten slice's late deletion changes nothing.
    assert idx.apply("DELETED", sl("vllm-1", "vllm", "10.0.0.1")) == {}
