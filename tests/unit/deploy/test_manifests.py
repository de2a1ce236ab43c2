"""The Kubernetes manifests under deploy/: valid objects, real CLI flags, a valid config,
an Envoy bootstrap that matches the template, and list/watch-only RBAC."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from modeldock.cli import build_parser
from modeldock.config import Config, parse_config
from modeldock.envoy import envoy_binary

DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
K8S_VERSION = "1.31"
IMAGE = "ghcr.io/example/modeldock:0.1.0"
SA_TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
REGENERATE = (
    "regenerate deploy/30-envoy-bootstrap.yaml: run `modeldock envoy-config <the flags in its "
    "modeldock.example/envoy-config-args annotation>` and paste the output under data.envoy.yaml"
)

Obj = dict[str, Any]


def load_documents() -> list[tuple[str, Obj]]:
    found: list[tuple[str, Obj]] = []
    for path in sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")]):
        if "mesh" in path.relative_to(DEPLOY).parts:
            continue  # another installation, checked by test_mesh_recipes.py
        for index, doc in enumerate(yaml.safe_load_all(path.read_text(encoding="utf-8"))):
            if doc is not None:
                found.append((f"{path.relative_to(DEPLOY)}#{index}", doc))
    return found


DOCUMENTS = load_documents()


def objects(kind: str) -> list[Obj]:
    return [obj for _, obj in DOCUMENTS if obj.get("kind") == kind]


def one(kind: str, name: str | None = None) -> Obj:
    matches = [obj for obj in objects(kind) if name is None or obj["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name or ''} under deploy/, found {len(matches)}"
    return matches[0]


def deployment() -> Obj:
    return one("Deployment", "modeldock")


def pod_spec() -> Obj:
    spec: Obj = deployment()["spec"]["template"]["spec"]
    return spec


def all_containers() -> list[Obj]:
    spec = pod_spec()
    return [*spec.get("initContainers", []), *spec["containers"]]


def container(name: str) -> Obj:
    matches = [c for c in all_containers() if c["name"] == name]
    assert len(matches) == 1, f"no container {name!r}"
    return matches[0]


def command_line(c: Obj) -> list[str]:
    return [str(part) for part in (*c.get("command", ()), *c.get("args", ()))]


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """Parse like the real `modeldock` command; an unknown flag fails the test with argparse's message."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"`modeldock {shlex.join(argv)}` is rejected by the CLI: {errors.getvalue().strip()}")


def modeldock_args(name: str) -> argparse.Namespace:
    argv = command_line(container(name))
    assert argv[0] == "modeldock", f"container {name} does not run modeldock: {argv}"
    return parse_cli(argv[1:])


def container_port(c: Obj, port: int | str) -> int:
    """A probe or Service port (a number or a containerPort name) as a number declared on `c`."""
    declared = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
    if isinstance(port, str):
        assert port in declared, f"{c['name']} has no port named {port!r}"
        return int(declared[port])
    assert port in declared.values(), f"{c['name']} does not declare port {port}"
    return port


def mounted_path(c: Obj, volume: str) -> str:
    mounts = [m["mountPath"] for m in c.get("volumeMounts", []) if m["name"] == volume]
    assert len(mounts) == 1, f"{c['name']} does not mount volume {volume!r}"
    return str(mounts[0])


def volume(name: str) -> Obj:
    matches = [v for v in pod_spec()["volumes"] if v["name"] == name]
    assert len(matches) == 1, f"no volume {name!r}"
    return matches[0]


def envoy_configmap() -> Obj:
    return one("ConfigMap", "modeldock-envoy")


def bootstrap() -> Obj:
    data: Obj = yaml.safe_load(envoy_configmap()["data"]["envoy.yaml"])
    return data


def config_secret() -> Obj:
    return one("Secret", "modeldock-config")


def gateway_config() -> Config:
    text = config_secret()["stringData"]["config.yaml"]
    return parse_config(yaml.safe_load(text), "deploy/20-config.yaml: stringData.config.yaml")


def static_cluster_port(name: str) -> tuple[str, int]:
    for cluster in bootstrap()["static_resources"]["clusters"]:
        if cluster["name"] == name:
            endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
            socket = endpoint["address"]["socket_address"]
            return socket["address"], int(socket["port_value"])
    raise AssertionError(f"no static cluster {name} in the Envoy bootstrap")


# ---- every object ----------------------------------------------------------------------


def test_deploy_holds_the_whole_installation() -> None:
    kinds = {obj["kind"] for _, obj in DOCUMENTS}
    assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "Secret", "ConfigMap", "Deployment",
            "Service"} <= kinds


@pytest.mark.parametrize(("source", "obj"), DOCUMENTS, ids=[source for source, _ in DOCUMENTS])
def test_every_document_is_a_valid_kubernetes_object(source: str, obj: Obj) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_namespaced_objects_name_their_namespace() -> None:
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for source, obj in DOCUMENTS:
        if obj["kind"] not in cluster_scoped:
            assert obj["metadata"].get("namespace"), f"{source}: {obj['kind']} has no namespace"


def test_images_are_the_one_modeldock_image() -> None:
    assert {c["image"] for c in all_containers()} == {IMAGE}
    assert "pip install ." in (DEPLOY / "README.md").read_text(encoding="utf-8")


# ---- the commands ----------------------------------------------------------------------


def test_modeldock_commands_use_real_cli_flags() -> None:
    xds, extproc = modeldock_args("xds"), modeldock_args("extproc")
    assert xds.command == "xds" and extproc.command == "extproc"
    assert xds.kubeconfig is None, "in a pod, discovery uses the service account (in-cluster config)"
    assert extproc.xds == f"127.0.0.1:{xds.port}", "ext_proc subscribes to the xDS server in its own pod"
    # Draining: ext_proc gets SIGTERM only after Envoy has exited, so its grace is short.
    assert 0 < extproc.grace < pod_spec()["terminationGracePeriodSeconds"]
    for name, args in (("xds", xds), ("extproc", extproc)):
        c = container(name)
        container_port(c, args.metrics_port)


def test_grpc_listens_on_loopback_and_only_metrics_on_the_pod_address() -> None:
    for name in ("xds", "extproc"):
        args, c = modeldock_args(name), container(name)
        assert args.host == "127.0.0.1", f"{name} serves plaintext gRPC: loopback only"
        assert args.metrics_host == "0.0.0.0" and args.metrics_port != args.port
        assert args.port not in {p["containerPort"] for p in c.get("ports", [])}
        # The kubelet's own gRPC probe dials the pod IP, which nothing listens on: probe from inside.
        for kind in ("startupProbe", "readinessProbe"):
            probe = c[kind]
            assert "grpc" not in probe, f"{name} {kind}"
            script = check_python(probe["exec"]["command"], f"{name} {kind}")
            assert f"'127.0.0.1:{args.port}'" in script and "HealthStub" in script


def test_both_services_read_the_config_secret() -> None:
    xds, extproc = modeldock_args("xds"), modeldock_args("extproc")
    assert xds.config == extproc.config
    assert volume("config")["secret"]["secretName"] == config_secret()["metadata"]["name"]
    key = Path(xds.config).name
    assert key in config_secret()["stringData"]
    for name in ("xds", "extproc"):
        # A directory mount (no subPath), so an updated Secret reaches the file and ext_proc re-reads it.
        assert Path(xds.config).parent == Path(mounted_path(container(name), "config"))


def test_config_is_a_valid_modeldock_config_with_kubernetes_targets() -> None:
    config = gateway_config()
    assert config.models and all(m.kubernetes is not None for m in config.models)
    assert config.tenants and all(t.api_key_hashes for t in config.tenants)
    # `modeldock config check` is what an operator runs on it.
    args = parse_cli(["config", "check", "config.yaml"])
    assert args.command == "config"


def test_envoy_bootstrap_is_what_envoy_config_renders() -> None:
    flags = shlex.split(envoy_configmap()["metadata"]["annotations"]["modeldock.example/envoy-config-args"])
    args = parse_cli(["envoy-config", *flags])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert args.func(args) == 0
    assert yaml.safe_load(out.getvalue()) == bootstrap(), REGENERATE


def test_envoy_bootstrap_points_at_the_pod_and_the_listener_at_the_service() -> None:
    xds, extproc = modeldock_args("xds"), modeldock_args("extproc")
    assert static_cluster_port("modeldock_xds") == ("127.0.0.1", xds.port)
    assert static_cluster_port("modeldock_extproc") == ("127.0.0.1", extproc.port)
    listener = bootstrap()["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener["address"] == "0.0.0.0"
    envoy = container("envoy")
    service = one("Service", "modeldock")
    assert [container_port(envoy, p["targetPort"]) for p in service["spec"]["ports"]] == [listener["port_value"]]
    labels = deployment()["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    admin = bootstrap()["admin"]["address"]["socket_address"]
    assert admin["address"] == "127.0.0.1", "Envoy's admin API must not be reachable from outside the pod"


def test_envoy_accepts_its_command_line_and_bootstrap(tmp_path: Path) -> None:
    envoy = container("envoy")
    argv = command_line(envoy)
    assert argv[0] == "envoy"
    config_path = argv[argv.index("-c") + 1]
    assert Path(config_path).parent == Path(mounted_path(envoy, "envoy-bootstrap"))
    assert volume("envoy-bootstrap")["configMap"]["name"] == envoy_configmap()["metadata"]["name"]
    local = tmp_path / Path(config_path).name
    local.write_text(envoy_configmap()["data"][local.name], encoding="utf-8")
    argv = [envoy_binary(), *argv[1:]]
    argv[argv.index("-c") + 1] = str(local)
    result = subprocess.run([*argv, "--mode", "validate"], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "OK" in result.stdout + result.stderr


# ---- access ----------------------------------------------------------------------------


def test_rbac_is_namespaced_list_watch_on_endpointslices_for_every_model() -> None:
    assert not objects("ClusterRole") and not objects("ClusterRoleBinding")
    rule = {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}
    roles = {(r["metadata"]["namespace"], r["metadata"]["name"]): r for r in objects("Role")}
    for role in roles.values():
        assert [{**r, "verbs": sorted(r["verbs"])} for r in role["rules"]] == [rule]
    account = pod_spec()["serviceAccountName"]
    home = deployment()["metadata"]["namespace"]
    assert one("ServiceAccount", account)["metadata"]["namespace"] == home
    subject = {"kind": "ServiceAccount", "name": account, "namespace": home}
    granted = set()
    for binding in objects("RoleBinding"):
        namespace = binding["metadata"]["namespace"]
        assert binding["roleRef"]["kind"] == "Role"
        assert (namespace, binding["roleRef"]["name"]) in roles, f"RoleBinding in {namespace} names a missing Role"
        if subject in binding["subjects"]:
            granted.add(namespace)
    needed = {m.kubernetes.namespace for m in gateway_config().models if m.kubernetes is not None}
    assert needed <= granted, f"no list/watch grant in {sorted(needed - granted)}"


def test_only_the_xds_container_gets_api_credentials() -> None:
    account = one("ServiceAccount", pod_spec()["serviceAccountName"])
    assert account.get("automountServiceAccountToken") is False
    assert pod_spec()["automountServiceAccountToken"] is False
    sources = volume("kube-api-access")["projected"]["sources"]
    assert any("serviceAccountToken" in s for s in sources)
    holders = [c["name"] for c in all_containers()
               if any(m["name"] == "kube-api-access" for m in c.get("volumeMounts", []))]
    assert holders == ["xds"]
    assert mounted_path(container("xds"), "kube-api-access") == SA_TOKEN_PATH


def test_network_policy_opens_the_gateway_and_metrics_but_not_grpc() -> None:
    policy = one("NetworkPolicy", "modeldock")
    open_ports = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    xds, extproc = modeldock_args("xds"), modeldock_args("extproc")
    assert open_ports == {8080, xds.metrics_port, extproc.metrics_port}
    assert xds.port not in open_ports and extproc.port not in open_ports


# ---- lifecycle -------------------------------------------------------------------------


def test_sidecars_start_in_order_and_stop_after_envoy() -> None:
    spec = pod_spec()
    assert [c["name"] for c in spec["initContainers"]] == ["xds", "extproc"]
    assert all(c.get("restartPolicy") == "Always" for c in spec["initContainers"]), "native sidecars"
    assert [c["name"] for c in spec["containers"]] == ["envoy"]


def test_every_container_has_probes_and_resources() -> None:
    for c in all_containers():
        for kind in ("readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            assert probe, f"{c['name']} has no {kind}"
            for action in ("tcpSocket", "httpGet"):
                if action in probe:
                    container_port(c, probe[action]["port"])
            if "exec" in probe:
                check_python(probe["exec"]["command"], f"{c['name']} {kind}")
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["resources"]["limits"]["memory"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_termination_grace_covers_envoy_draining() -> None:
    envoy = container("envoy")
    script = check_python(envoy["lifecycle"]["preStop"]["exec"]["command"], "envoy preStop")
    assert "/drain_listeners?graceful" in script
    first_sleep = re.search(r"time\.sleep\((\d+)\)", script)
    bounded_wait = re.search(r"monotonic\(\) \+ (\d+)", script)
    assert first_sleep and bounded_wait, "the preStop hook waits a bounded time"
    # The pause for endpoint removal, the bounded wait for open requests, then ext_proc's own drain.
    needed = int(first_sleep.group(1)) + int(bounded_wait.group(1)) + modeldock_args("extproc").grace
    assert pod_spec()["terminationGracePeriodSeconds"] >= needed


def check_python(command: list[str], where: str) -> str:
    """An exec hook or probe that runs `python -c SCRIPT`: the script must compile."""
    assert command[:2] == ["python", "-c"], f"{where}: expected python -c, got {command[:2]}"
    compile(command[2], where, "exec")
    return command[2]
