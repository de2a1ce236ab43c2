"""Active-active replicas in the manifests (deploy/ and the mesh recipes): the replicas share one
Redis for request limits and token budgets (the config's redis_url names its Service), spread over
nodes where they can, and keep one up through voluntary disruptions (a PodDisruptionBudget)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from modeldock.config import Config, parse_config
from tests.unit.deploy import test_manifests as gateway
from tests.unit.deploy import test_mesh_recipes as mesh

Obj = dict[str, Any]

# (what, every object of that installation, its gateway Deployment, its config Secret)
INSTALLATIONS = [
    ("deploy", [obj for _, obj in gateway.DOCUMENTS], "modeldock", "modeldock-config"),
    *[(f"mesh/{g}", mesh.recipe(g), "modeldock-picker", "modeldock-picker-config") for g in mesh.GATEWAYS],
]
IDS = [what for what, *_ in INSTALLATIONS]


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels only: all these manifests use) that picks pods labelled `labels`."""
    assert set(selector) == {"matchLabels"}, f"unexpected selector form {selector}"
    match: dict[str, str] = selector["matchLabels"]
    return bool(match) and match.items() <= labels.items()


def pod_labels(workload: Obj) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def config_of(objs: list[Obj], secret: str) -> Config:
    text = find(objs, "Secret", secret)["stringData"]["config.yaml"]
    return parse_config(yaml.safe_load(text), f"{secret}: config.yaml")


def redis_service(objs: list[Obj], secret: str) -> tuple[Obj, int]:
    """The Service (and its port) the config's limits.redis_url names, by its cluster DNS name."""
    url = config_of(objs, secret).limits.redis_url
    assert url is not None, "limits.redis_url is unset: each replica would count every limit on its own"
    parts = urlsplit(url)
    assert parts.scheme == "redis" and parts.hostname and parts.port, url
    name, namespace, *domain = parts.hostname.split(".")
    assert domain in (["svc"], ["svc", "cluster", "local"]), f"{parts.hostname} is not a Service's DNS name"
    service = find(objs, "Service", name)
    assert service["metadata"]["namespace"] == namespace
    assert service["spec"].get("clusterIP") != "None", "clients use the ClusterIP Service (a stable address)"
    ports = [p for p in service["spec"]["ports"] if p["port"] == parts.port]
    assert len(ports) == 1, f"{name} has no port {parts.port}"
    return service, parts.port


def redis_statefulset(objs: list[Obj], service: Obj) -> Obj:
    backing = [o for o in objs if o["kind"] == "StatefulSet"
               and o["metadata"]["namespace"] == service["metadata"]["namespace"]
               and selects({"matchLabels": service["spec"]["selector"]}, pod_labels(o))]
    assert len(backing) == 1, f"Service {service['metadata']['name']} selects {len(backing)} StatefulSets"
    return backing[0]


def flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} missing from {argv}"
    return argv[argv.index(name) + 1]


# ---- spread and disruptions ------------------------------------------------------------


@pytest.mark.parametrize(("what", "objs", "deployment", "secret"), INSTALLATIONS, ids=IDS)
def test_replicas_spread_over_nodes(what: str, objs: list[Obj], deployment: str, secret: str) -> None:
    workload = find(objs, "Deployment", deployment)
    assert workload["spec"]["replicas"] >= 2, what
    affinity = workload["spec"]["template"]["spec"].get("affinity", {}).get("podAntiAffinity")
    assert affinity, f"{what}: no podAntiAffinity, both replicas may land on one node"
    # Preferred, not required: a one-node cluster (or a rollout's surge pod) must still schedule.
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity
    terms = [t["podAffinityTerm"] for t in affinity["preferredDuringSchedulingIgnoredDuringExecution"]]
    assert any(t["topologyKey"] == "kubernetes.io/hostname" and selects(t["labelSelector"], pod_labels(workload))
               for t in terms), f"{what}: no hostname anti-affinity term that selects the replicas' own pods"


@pytest.mark.parametrize(("what", "objs", "deployment", "secret"), INSTALLATIONS, ids=IDS)
def test_a_disruption_budget_keeps_one_replica_up(what: str, objs: list[Obj], deployment: str, secret: str) -> None:
    workload = find(objs, "Deployment", deployment)
    namespace = workload["metadata"]["namespace"]
    budgets = [p for p in objs if p["kind"] == "PodDisruptionBudget" and p["metadata"]["namespace"] == namespace
               and selects(p["spec"]["selector"], pod_labels(workload))]
    assert len(budgets) == 1, f"{what}: {len(budgets)} PodDisruptionBudgets select the {deployment} pods"
    spec = budgets[0]["spec"]
    replicas = workload["spec"]["replicas"]
    if "minAvailable" in spec:
        assert 1 <= int(spec["minAvailable"]) < replicas, f"{what}: minAvailable {spec['minAvailable']}"
    else:
        assert 1 <= int(spec["maxUnavailable"]) < replicas, f"{what}: maxUnavailable {spec['maxUnavailable']}"


# ---- the shared Redis ------------------------------------------------------------------


@pytest.mark.parametrize(("what", "objs", "deployment", "secret"), INSTALLATIONS, ids=IDS)
def test_redis_url_names_the_shared_redis_service(what: str, objs: list[Obj], deployment: str, secret: str) -> None:
    service, port = redis_service(objs, secret)
    target = next(p["targetPort"] for p in service["spec"]["ports"] if p["port"] == port)
    redis = redis_statefulset(objs, service)
    assert redis["spec"]["replicas"] == 1, "one Redis: the windows must not be split over unsynchronised copies"
    (server,) = redis["spec"]["template"]["spec"]["containers"]
    declared = {p["name"]: p["containerPort"] for p in server["ports"]}
    listens = int(flag(server["command"], "--port"))
    assert declared.get(target, target) == listens, f"{what}: the Service leads to {target}, Redis listens on {listens}"
    # The headless Service the StatefulSet names exists and selects the same pod.
    headless = find(objs, "Service", redis["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert selects({"matchLabels": headless["spec"]["selector"]}, pod_labels(redis))


@pytest.mark.parametrize(("what", "objs", "deployment", "secret"), INSTALLATIONS, ids=IDS)
def test_redis_is_pinned_probed_bounded_and_fenced(what: str, objs: list[Obj], deployment: str, secret: str) -> None:
    service, _ = redis_service(objs, secret)
    redis = redis_statefulset(objs, service)
    spec = redis["spec"]["template"]["spec"]
    (server,) = spec["containers"]
    image_tag = server["image"].rpartition(":")[2]
    assert "/" not in image_tag and image_tag not in ("", "latest"), f"{what}: image {server['image']} not pinned"
    for kind in ("readinessProbe", "livenessProbe"):
        script = " ".join(server[kind]["exec"]["command"])
        assert "-cli" in script and " ping" in script, f"{what}: {kind} does not ping Redis"
    assert "PONG" in " ".join(server["readinessProbe"]["exec"]["command"]), "ready only when it answers PONG"
    assert server["resources"]["requests"]["cpu"] and server["resources"]["requests"]["memory"]
    assert server["resources"]["limits"]["memory"]
    # Evicting a window's keys would under-count: a full Redis must refuse writes instead.
    assert flag(server["command"], "--maxmemory-policy") == "noeviction"
    assert server["securityContext"]["allowPrivilegeEscalation"] is False
    # /data is a PVC (or an emptyDir): somewhere writable under a read-only root filesystem.
    (data,) = [m["name"] for m in server["volumeMounts"] if m["mountPath"] == flag(server["command"], "--dir")]
    claims = {c["metadata"]["name"] for c in redis["spec"].get("volumeClaimTemplates", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    assert data in claims or "emptyDir" in volumes.get(data, {}), f"{what}: /data is not a PVC or emptyDir"
    # No password, so only the gateway's own pods may connect.
    workload = find(objs, "Deployment", deployment)
    policies = [p for p in objs
                if p["kind"] == "NetworkPolicy" and selects(p["spec"]["podSelector"], pod_labels(redis))]
    assert len(policies) == 1, f"{what}: Redis has {len(policies)} NetworkPolicies"
    rules = policies[0]["spec"]["ingress"]
    assert rules and all(rule.get("from") for rule in rules), f"{what}: Redis is open to every pod"
    assert all(selects(peer["podSelector"], pod_labels(workload)) and "namespaceSelector" not in peer
               for rule in rules for peer in rule["from"]), f"{what}: Redis admits pods other than {deployment}"
