"""The recipes under deploy/mesh/ (modeldock as the endpoint picker of an InferencePool behind
Envoy Gateway or Istio): built-in kinds against the Kubernetes schema, custom resources against the
schemas in tests/support/crds/ (no field they do not list), real CLI flags and a valid modeldock
config, references that resolve, and the Envoy configs under tests/e2e/mesh/ accepted by Envoy."""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from string import Template
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from modeldock.config import parse_config
from modeldock.envoy import envoy_binary
from tests.unit.deploy.test_manifests import K8S_VERSION, command_line, parse_cli

ROOT = Path(__file__).resolve().parents[3]
MESH = ROOT / "deploy" / "mesh"
CRDS = ROOT / "tests" / "support" / "crds"
BOOTSTRAPS = ROOT / "tests" / "e2e" / "mesh"
GATEWAYS = ("envoy-gateway", "istio")

Obj = dict[str, Any]


def load(directory: Path) -> list[tuple[str, Obj]]:
    found: list[tuple[str, Obj]] = []
    for path in sorted(directory.glob("*.yaml")):
        for index, doc in enumerate(yaml.safe_load_all(path.read_text(encoding="utf-8"))):
            if doc is not None:
                found.append((f"{path.relative_to(MESH)}#{index}", doc))
    return found


def recipe(gateway: str) -> list[Obj]:
    """What `kubectl apply -f deploy/mesh/picker/ -f deploy/mesh/<gateway>/` creates."""
    return [obj for _, obj in [*load(MESH / "picker"), *load(MESH / gateway)]]


DOCUMENTS = [doc for d in sorted(p for p in MESH.iterdir() if p.is_dir()) for doc in load(d)]


def schema_for(obj: Obj) -> Obj | None:
    group, _, version = obj["apiVersion"].rpartition("/")
    if "." not in group:
        return None  # a built-in kind (core has no group; apps, rbac.authorization.k8s.io, ... )
    path = CRDS / f"{obj['kind'].lower()}.{group}.{version}.json"
    if not path.exists() and group.endswith(".k8s.io") and not group.startswith(("gateway.", "inference.")):
        return None  # rbac.authorization.k8s.io, networking.k8s.io, discovery.k8s.io: built in
    assert path.exists(), f"no schema for {obj['kind']} {obj['apiVersion']}: write {path.relative_to(ROOT)}"
    schema: Obj = json.loads(path.read_text(encoding="utf-8"))
    return schema


def crd_errors(obj: Obj) -> list[str]:
    schema = schema_for(obj)
    assert schema is not None
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(obj)]


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


# ---- every document --------------------------------------------------------------------


def test_every_recipe_has_the_picker_the_pool_and_the_route() -> None:
    for gateway in GATEWAYS:
        kinds = {o["kind"] for o in recipe(gateway)}
        assert {"Deployment", "Service", "Secret", "InferencePool", "Gateway", "HTTPRoute"} <= kinds, gateway


@pytest.mark.parametrize(("source", "obj"), DOCUMENTS, ids=[source for source, _ in DOCUMENTS])
def test_every_document_is_valid(source: str, obj: Obj) -> None:
    if schema_for(obj) is None:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    else:
        assert crd_errors(obj) == [], source
    if obj["kind"] not in {"GatewayClass"}:
        assert obj["metadata"].get("namespace"), f"{source}: no namespace"


def assert_closed(name: str, node: Any, where: str) -> None:
    """Every object schema under `node` (in CRD file `name`) forbids unknown properties."""
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, f"{name}: {where} is not closed"
        for key, value in node.items():
            assert_closed(name, value, f"{where}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            assert_closed(name, value, f"{where}[{i}]")


def test_every_custom_kind_the_recipes_use_has_a_strict_schema() -> None:
    for path in CRDS.glob("*.json"):
        schema = json.loads(path.read_text(encoding="utf-8"))
        jsonschema.Draft202012Validator.check_schema(schema)
        assert_closed(path.name, schema, "$")
    used = {(o["kind"], o["apiVersion"]) for _, o in DOCUMENTS if schema_for(o) is not None}
    assert {k for k, _ in used} == {"InferencePool", "HTTPRoute", "Gateway", "GatewayClass"}


# ---- the schemas catch mistakes --------------------------------------------------------


def pool() -> Obj:
    return copy.deepcopy(find(recipe("istio"), "InferencePool", "vllm-llama-8b"))


def route() -> Obj:
    return copy.deepcopy(find(recipe("istio"), "HTTPRoute", "llm-route"))


def test_a_misspelled_field_fails() -> None:
    obj = pool()
    obj["spec"]["endpointPickerRef"]["failuremode"] = obj["spec"]["endpointPickerRef"].pop("failureMode")
    assert any("failuremode" in e for e in crd_errors(obj))
    obj = route()
    obj["spec"]["rules"][0]["backendRef"] = obj["spec"]["rules"][0].pop("backendRefs")
    assert any("backendRef" in e for e in crd_errors(obj))


def test_the_old_extension_ref_field_fails() -> None:
    # v1alpha2 spelled the picker `extensionRef`; v1 renamed it to endpointPickerRef.
    obj = pool()
    obj["spec"]["extensionRef"] = obj["spec"].pop("endpointPickerRef")
    errors = crd_errors(obj)
    assert any("extensionRef" in e for e in errors) and any("endpointPickerRef" in e for e in errors)


@pytest.mark.parametrize(("path", "value"), [
    (("spec", "endpointPickerRef", "failureMode"), "FailClosed"),
    (("spec", "appProtocol"), "h2c"),
    (("spec", "targetPorts"), []),
    (("spec", "targetPorts", 0, "number"), 70000),
])
def test_a_wrong_value_fails(path: tuple[str | int, ...], value: Any) -> None:
    obj = pool()
    node: Any = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert crd_errors(obj), f"{'.'.join(map(str, path))} = {value!r} was accepted"


def test_a_service_picker_needs_its_port() -> None:
    obj = pool()
    del obj["spec"]["endpointPickerRef"]["port"]
    assert crd_errors(obj)


def test_a_wrong_route_match_type_fails() -> None:
    obj = route()
    obj["spec"]["rules"][0]["matches"][0]["path"]["type"] = "Prefix"
    assert crd_errors(obj)


# ---- references ------------------------------------------------------------------------


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_route_pool_and_picker_refer_to_each_other(gateway: str) -> None:
    objs = recipe(gateway)
    http_route = find(objs, "HTTPRoute", "llm-route")
    backends = [b for rule in http_route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends and all(b["kind"] == "InferencePool" and b["group"] == "inference.networking.k8s.io"
                            for b in backends)
    for ref in http_route["spec"]["parentRefs"]:
        gw = find(objs, "Gateway", ref["name"])
        assert gw["metadata"]["namespace"] == http_route["metadata"]["namespace"]
    for backend in backends:
        inference_pool = find(objs, "InferencePool", backend["name"])
        picker_ref = inference_pool["spec"]["endpointPickerRef"]
        assert picker_ref.get("kind", "Service") == "Service"
        service = find(objs, "Service", picker_ref["name"])
        assert service["metadata"]["namespace"] == inference_pool["metadata"]["namespace"]
        port = [p for p in service["spec"]["ports"] if p["port"] == picker_ref["port"]["number"]]
        assert len(port) == 1, "endpointPickerRef.port is a port of the picker Service"
        # The Service port leads to the port `modeldock extproc` listens on.
        deployment = find(objs, "Deployment", picker_ref["name"])
        extproc = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "extproc"][0]
        declared = {p["name"]: p["containerPort"] for p in extproc["ports"]}
        assert parse_cli(command_line(extproc)[1:]).port == declared[port[0]["targetPort"]]
        assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_modeldock_discovers_the_pools_pods(gateway: str) -> None:
    objs = recipe(gateway)
    secret = find(objs, "Secret", "modeldock-picker-config")
    config = parse_config(yaml.safe_load(secret["stringData"]["config.yaml"]), "modeldock-picker-config")
    inference_pool = find(objs, "InferencePool", "vllm-llama-8b")
    pool_ports = {p["number"] for p in inference_pool["spec"]["targetPorts"]}
    for model in config.models:
        assert model.kubernetes is not None
        service = find(objs, "Service", model.kubernetes.service)
        assert service["spec"]["selector"] == inference_pool["spec"]["selector"]["matchLabels"]
        port = [p for p in service["spec"]["ports"] if model.kubernetes.port in (p["name"], p["targetPort"])]
        assert len(port) == 1 and port[0]["targetPort"] in pool_ports


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_picker_commands_use_real_cli_flags_and_one_config(gateway: str) -> None:
    deployment = find(recipe(gateway), "Deployment", "modeldock-picker")
    spec = deployment["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in [*spec["initContainers"], *spec["containers"]]}
    xds = parse_cli(command_line(containers["xds"])[1:])
    extproc = parse_cli(command_line(containers["extproc"])[1:])
    assert (xds.command, extproc.command) == ("xds", "extproc")
    assert extproc.xds == f"127.0.0.1:{xds.port}" and xds.config == extproc.config
    assert 0 < extproc.drain_delay + extproc.grace < spec["terminationGracePeriodSeconds"]
    holders = [n for n, c in containers.items() if any(m["name"] == "kube-api-access" for m in c["volumeMounts"])]
    assert holders == ["xds"], "only discovery gets API credentials"
    # Picker mode: one endpoint for Envoy AI Gateway's ORIGINAL_DST cluster, over TLS (its picker cluster
    # speaks only TLS); the ranked list for Istio's override_host cluster, in plaintext HTTP/2.
    if gateway == "envoy-gateway":
        assert extproc.picker == "one"
        mounts = {m["mountPath"]: m["name"] for m in containers["extproc"]["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        for path in (extproc.tls_cert, extproc.tls_key):
            volume = volumes[mounts[str(Path(path).parent)]]
            assert volume["secret"]["secretName"] == "modeldock-picker-tls"
    else:
        assert (extproc.picker, extproc.tls_cert, extproc.tls_key) == ("list", None, None)
    role = find(recipe(gateway), "Role", "modeldock-picker-endpointslice-reader")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                              "verbs": ["list", "watch"]}]


# ---- the Envoy configs the gateways produce --------------------------------------------


def render(name: str) -> str:
    return Template((BOOTSTRAPS / name).read_text(encoding="utf-8")).substitute(
        listen_port=18080, admin_port=19901, epp_host="127.0.0.1", epp_port=9002,
        pool_lb_endpoints="[{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 8000}}}}]")


@pytest.mark.parametrize("name", ["envoy-gateway.yaml", "istio.yaml"])
def test_gateway_envoy_config_renders_and_envoy_accepts_it(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text(render(name), encoding="utf-8")
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "OK" in result.stdout + result.stderr


def ext_proc_modes(name: str) -> Obj:
    bootstrap = yaml.safe_load(render(name))
    route_cfg = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    if name == "istio.yaml":
        per_route = route_cfg["route_config"]["virtual_hosts"][0]["routes"][0]["typed_per_filter_config"]
        modes: Obj = per_route["envoy.filters.http.ext_proc"]["overrides"]["processing_mode"]
        return modes
    modes = route_cfg["http_filters"][0]["typed_config"]["processing_mode"]
    return modes


@pytest.mark.parametrize("name", ["envoy-gateway.yaml", "istio.yaml"])
def test_both_gateways_stream_both_bodies_to_the_picker(name: str) -> None:
    # What docs/mesh.md builds on: every phase is sent, bodies full duplex.
    assert ext_proc_modes(name) == {
        "request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED", "request_trailer_mode": "SEND",
        "response_header_mode": "SEND", "response_body_mode": "FULL_DUPLEX_STREAMED", "response_trailer_mode": "SEND"}


def test_envoy_gateway_annotation_matches_its_config() -> None:
    annotations = find(recipe("envoy-gateway"), "InferencePool", "vllm-llama-8b")["metadata"]["annotations"]
    assert annotations["aigateway.envoyproxy.io/processing-body-mode"] == "duplex"
    assert ext_proc_modes("envoy-gateway.yaml")["request_body_mode"] == "FULL_DUPLEX_STREAMED"
