"""The ADS server against a real Envoy, in state-of-the-world and in delta mode.

The xDS server runs in this process; Envoy is a child process with modeldock's
own bootstrap (ext_proc is not running: CDS and EDS do not need it). What Envoy
applied is read from its admin interface.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.cluster.v3 import cluster_pb2
from google.protobuf import duration_pb2

from modeldock.config import parse_config
from modeldock.envoy import BootstrapOptions, envoy_binary, render_bootstrap
from modeldock.types import Endpoint
from modeldock.up import free_port
from modeldock.xds.app import XdsOptions, XdsServer
from modeldock.xds.cache import ResourceSet, pack
from modeldock.xds.resources import CLUSTER_TYPE, ENDPOINT_TYPE

pytestmark = pytest.mark.e2e

CONFIG = {
    "models": [
        {"name": "a", "endpoints": ["127.0.0.1:9001"]},
        {"name": "b", "endpoints": ["127.0.0.1:9002", "127.0.0.1:9003"]},
    ],
}
CDS, EDS = "Cluster", "ClusterLoadAssignment"  # metric labels


# Envoy must not outlive the test run, even if pytest is killed: set PR_SET_PDEATHSIG
# in a tiny exec wrapper (it survives execve) rather than in a preexec_fn, which
# would run Python after fork() in a process that has gRPC threads.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def with_parent_death(cmd: list[str]) -> list[str]:
    return [sys.executable, "-c", _DIE_WITH_PARENT, *cmd] if sys.platform == "linux" else cmd


@dataclass
class World:
    mode: str
    xds: XdsServer
    admin: str
    envoy: subprocess.Popen[bytes]
    log: Path
    acks: list[tuple[str, str]] = field(default_factory=list)

    async def get(self, path: str) -> Any:
        def fetch() -> bytes:
            with urllib.request.urlopen(f"{self.admin}{path}", timeout=2) as resp:  # noqa: S310 (loopback)
                return bytes(resp.read())

        body = await asyncio.to_thread(fetch)
        return json.loads(body) if "json" in path or "config_dump" in path else body.decode()

    async def hosts(self) -> dict[str, list[str]]:
        """Cluster name -> host addresses, as Envoy's cluster manager has them."""
        data = await self.get("/clusters?format=json")
        out = {}
        for cluster in data.get("cluster_statuses", []):
            addrs = [h["address"]["socket_address"] for h in cluster.get("host_statuses", [])]
            out[cluster["name"]] = sorted(f"{a['address']}:{a['port_value']}" for a in addrs)
        return out

    async def stat(self, name: str) -> int:
        text = await self.get(f"/stats?filter=^{name.replace('.', '[.]')}$")
        return sum(int(line.split(": ", 1)[1]) for line in text.splitlines() if ": " in line)

    async def text_stat(self, name: str) -> str:
        text = await self.get(f"/stats?filter=^{name.replace('.', '[.]')}$")
        return text.split(": ", 1)[1].strip().strip('"') if ": " in text else ""

    def metric(self, name: str, type_label: str) -> float:
        return self.xds.registry.get_sample_value(name, {"type": type_label}) or 0.0

    def stop_discovery(self) -> None:
        """Freeze the cache: no confirmations, no ticks, so a hand-made set stays put."""
        for task in self.xds._tasks:
            task.cancel()

    def envoy_log(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


async def eventually(check: Callable[[], Awaitable[bool]], world: World, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert world.envoy.poll() is None, f"Envoy exited:\n{world.envoy_log()}"
        assert asyncio.get_running_loop().time() < deadline, f"timed out; Envoy log:\n{world.envoy_log()}"
        await asyncio.sleep(0.05)


def start_envoy(tmp_path: Path, xds_port: int, admin_port: int, mode: str) -> tuple[subprocess.Popen[bytes], Path]:
    bootstrap = yaml.safe_load(render_bootstrap(BootstrapOptions(
        listen_port=free_port(), admin_port=admin_port, xds_port=xds_port, extproc_port=free_port())))
    if mode == "delta":
        bootstrap["dynamic_resources"]["ads_config"]["api_type"] = "DELTA_GRPC"
    path = tmp_path / f"envoy-{mode}.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    log = tmp_path / f"envoy-{mode}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            with_parent_death([envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1",
                               "--log-level", "warn", "--drain-time-s", "0"]),
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )
    return proc, log


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def start_xds(path: Path, port: int = 0) -> XdsServer:
    xds = XdsServer(parse_config(CONFIG), XdsOptions(path, port=port, tick_seconds=0.05))
    await xds.start()
    return xds


@pytest.fixture(params=["sotw", "delta"])
async def world(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[World]:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    xds = await start_xds(path)
    admin_port = free_port()
    envoy, log = start_envoy(tmp_path, xds.bound_port, admin_port, request.param)
    w = World(request.param, xds, f"http://127.0.0.1:{admin_port}", envoy, log)
    xds.metrics.acked = lambda type_url, version: w.acks.append((type_url, version))  # type: ignore[method-assign]
    try:
        await eventually(lambda: synced(w), w)
        yield w
    finally:
        stop_process(envoy)
        await w.xds.stop(0.1)


async def synced(w: World) -> bool:
    try:
        hosts = await w.hosts()
    except OSError:
        return False  # admin not listening yet
    return hosts.get("model:a") == ["127.0.0.1:9001"] and hosts.get("model:b") == ["127.0.0.1:9002", "127.0.0.1:9003"]


def dump(config: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in config["configs"] if c["@type"].endswith(kind))


async def test_envoy_loads_cds_and_eds_and_acks_them(world: World) -> None:
    w = world
    current = w.xds.cache.current
    await eventually(lambda: _acked_both(w), w)
    config = await w.get("/config_dump?include_eds")
    clusters = {
        c["cluster"]["name"]: c["version_info"] for c in dump(config, "ClustersConfigDump")["dynamic_active_clusters"]
    }
    endpoints = {}
    for e in dump(config, "EndpointsConfigDump")["dynamic_endpoint_configs"]:
        cla = e["endpoint_config"]
        addrs = [lb["endpoint"]["address"]["socket_address"] for loc in cla["endpoints"] for lb in loc["lb_endpoints"]]
        endpoints[cla["cluster_name"]] = sorted(f"{a['address']}:{a['port_value']}" for a in addrs)
    assert endpoints == {"model:a": ["127.0.0.1:9001"], "model:b": ["127.0.0.1:9002", "127.0.0.1:9003"]}
    if w.mode == "sotw":  # one version for the whole response
        assert set(clusters.values()) == {current.versions[CLUSTER_TYPE]}
    else:  # one version per resource: its content hash
        assert clusters == {n: r.version for n, r in current.of(CLUSTER_TYPE).items()}
    # The config dump has no EDS versions; the cluster stat has the response's (system) version.
    for name in ("model_a", "model_b"):
        assert await w.text_stat(f"cluster.{name}.version_text") == current.versions[ENDPOINT_TYPE]
    assert await w.stat("control_plane.connected_state") == 1
    assert await w.stat("cluster_manager.cds.update_rejected") == 0


async def _acked_both(w: World) -> bool:
    versions = w.xds.cache.current.versions
    return (CLUSTER_TYPE, versions[CLUSTER_TYPE]) in w.acks and (ENDPOINT_TYPE, versions[ENDPOINT_TYPE]) in w.acks


async def test_endpoint_change_reaches_envoy_and_only_that_cluster(world: World) -> None:
    w = world
    b_updates = await w.stat("cluster.model_b.update_success")
    w.xds.store.update("a", [Endpoint("127.0.0.1", 9004), Endpoint("127.0.0.1", 9005)])
    await eventually(lambda: _hosts_of(w, "model:a", ["127.0.0.1:9004", "127.0.0.1:9005"]), w)
    w.xds.store.update("a", [])
    await eventually(lambda: _hosts_of(w, "model:a", []), w)
    assert (await w.hosts())["model:b"] == ["127.0.0.1:9002", "127.0.0.1:9003"]
    assert await w.stat("cluster.model_b.update_success") == b_updates  # b was not pushed again


async def _hosts_of(w: World, cluster: str, expected: list[str]) -> bool:
    return (await w.hosts()).get(cluster) == expected


async def test_rejected_endpoints_are_counted_kept_out_and_not_resent(world: World) -> None:
    w = world
    await eventually(lambda: _acked_both(w), w)
    pushes = w.metric("modeldock_xds_pushes_total", EDS)
    # The builder does not validate addresses; Envoy does, and NACKs the assignment.
    w.xds.store.update("a", [Endpoint("not-an-ip", 9001)])
    await eventually(lambda: _true(w.metric("modeldock_xds_nacks_total", EDS) == 1), w)
    assert await w.stat("cluster.model_a.update_rejected") == 1
    await asyncio.sleep(1.0)  # 20 ticks and a static-file confirmation: nothing is resent
    assert w.metric("modeldock_xds_nacks_total", EDS) == 1
    assert w.metric("modeldock_xds_pushes_total", EDS) == pushes + 1
    assert await w.stat("cluster.model_a.update_rejected") == 1
    assert (await w.hosts())["model:a"] == ["127.0.0.1:9001"]  # Envoy keeps the last good
    w.xds.store.update("a", [Endpoint("127.0.0.1", 9006)])
    await eventually(lambda: _hosts_of(w, "model:a", ["127.0.0.1:9006"]), w)
    assert w.metric("modeldock_xds_nacks_total", EDS) == 1


async def test_rejected_cluster_is_counted_and_not_resent(world: World) -> None:
    w = world
    await eventually(lambda: _acked_both(w), w)
    w.stop_discovery()
    good = w.xds.cache.current
    # Envoy requires connect_timeout > 0; the builder cannot produce this, so build it by hand.
    bad = cluster_pb2.Cluster(name="model:bad", type=cluster_pb2.Cluster.STATIC,
                              connect_timeout=duration_pb2.Duration(seconds=-1))
    clusters = {**good.of(CLUSTER_TYPE), "model:bad": pack("model:bad", bad)}
    pushes = w.metric("modeldock_xds_pushes_total", CDS)
    w.xds.cache.set(ResourceSet.build({**good.by_type, CLUSTER_TYPE: clusters}))
    await eventually(lambda: _true(w.metric("modeldock_xds_nacks_total", CDS) == 1), w)
    await eventually(lambda: _stat_is(w, "cluster_manager.cds.update_rejected", 1), w)
    await asyncio.sleep(0.5)
    assert w.metric("modeldock_xds_pushes_total", CDS) == pushes + 1
    assert w.metric("modeldock_xds_nacks_total", CDS) == 1
    assert "model:bad" not in await w.hosts()
    w.xds.cache.set(good)  # back to what Envoy has: at most a removal of what it never took
    await asyncio.sleep(0.5)
    assert w.metric("modeldock_xds_nacks_total", CDS) == 1
    assert await w.stat("cluster_manager.cds.update_rejected") == 1
    assert set(await w.hosts()) >= {"model:a", "model:b"}


async def _true(value: bool) -> bool:
    return value


async def _stat_is(w: World, name: str, value: int) -> bool:
    return await w.stat(name) == value


async def test_delta_reconnect_resends_nothing_envoy_already_has(tmp_path: Path) -> None:
    """After an xDS restart Envoy sends initial_resource_versions; equal content hashes mean no resend."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    xds = await start_xds(path)
    port = xds.bound_port
    admin_port = free_port()
    envoy, log = start_envoy(tmp_path, port, admin_port, "delta")
    w = World("delta", xds, f"http://127.0.0.1:{admin_port}", envoy, log)
    try:
        await eventually(lambda: synced(w), w)
        await eventually(lambda: _true(w.metric("modeldock_xds_pushes_total", EDS) >= 1), w)
        await xds.stop(0)
        w.xds = await start_xds(path, port)  # a new process's worth of state, same content
        await eventually(lambda: _true(w.xds.servicer.streams == 1), w, timeout=15)
        await eventually(lambda: _stat_is(w, "control_plane.connected_state", 1), w)
        await asyncio.sleep(0.5)
        # The wildcard CDS subscription gets one empty answer; EDS gets nothing at all.
        assert w.metric("modeldock_xds_resources_pushed_total", CDS) == 0
        assert w.metric("modeldock_xds_resources_pushed_total", EDS) == 0
        assert w.metric("modeldock_xds_pushes_total", EDS) == 0
        # The new server still serves changes on that stream.
        w.xds.store.update("b", [Endpoint("127.0.0.1", 9007)])
        await eventually(lambda: _hosts_of(w, "model:b", ["127.0.0.1:9007"]), w)
        assert w.metric("modeldock_xds_resources_pushed_total", EDS) == 1
    finally:
        stop_process(envoy)
        await w.xds.stop(0.1)
