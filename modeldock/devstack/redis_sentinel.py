"""A real Redis Sentinel topology on free loopback ports, for tests and benchmarks.

    with RedisSentinel() as topology:                   # 1 master, 1 replica, 3 Sentinels, quorum 2
        client = make_redis_client(topology.url, 0.5)   # redis+sentinel://127.0.0.1:p1,...,/modeldock/0
        killed = topology.kill_master()                 # SIGKILL the current master, like a crash
        promoted = topology.wait_for_failover(15.0)     # the replica the Sentinels promoted

Every node is a `RedisServer` (redis_server.py: the same binary, temp data dir, SIGKILL on close, at
interpreter exit and with the thread that started it), the replicas started with `--replicaof`, the
Sentinels from a config file they may rewrite, with `--sentinel`. `start` returns once the replicas
are in sync and every Sentinel sees them and the other Sentinels, so a failover can start at once.
`down_after_ms` (1000) and `failover_timeout_ms` (2000) are short, so a killed master is replaced in
a few seconds (down after 1 s, a vote, up to 1 s of Sentinel's own random delay, the promotion).
Replication is asynchronous, as in production: a write the master acknowledged in the last moment
before it died may not be on the replica that takes over.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

from modeldock.devstack.redis_server import RedisServer, free_port, node_client, node_info
from modeldock.devstack.redis_server import wait_for as _wait

__all__ = ["RedisSentinel", "TLSFiles"]

MASTER_NAME = "modeldock"


@dataclass(frozen=True)
class TLSFiles:
    """A CA and a server certificate (with its key) for every node and Sentinel: the topology then speaks
    TLS only (`rediss+sentinel://`), replication and the Sentinels' own links included."""

    ca: Path
    cert: Path
    key: Path

    def server_args(self, port: int) -> tuple[str, ...]:
        return ("--port", "0", "--tls-port", str(port), "--tls-cert-file", str(self.cert),
                "--tls-key-file", str(self.key), "--tls-ca-cert-file", str(self.ca),
                "--tls-replication", "yes", "--tls-auth-clients", "no")

    def client_kwargs(self) -> dict[str, Any]:
        return {"ssl": True, "ssl_ca_certs": str(self.ca), "ssl_check_hostname": False}


class RedisSentinel:
    def __init__(
        self,
        *,
        master_name: str = MASTER_NAME,
        replicas: int = 1,
        sentinels: int = 3,
        quorum: int = 2,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 2000,
        binary: str | None = None,
        startup_timeout_s: float = 20.0,
        tls: TLSFiles | None = None,
    ) -> None:
        if not 1 <= quorum <= sentinels:
            raise ValueError("the quorum must be between 1 and the number of Sentinels")
        self.master_name = master_name
        self.replica_count = replicas
        self.sentinel_count = sentinels
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.binary = binary
        self.startup_timeout_s = startup_timeout_s
        self.tls = tls
        self.nodes: list[RedisServer] = []  # the data nodes, the first master first
        self.sentinels: list[RedisServer] = []
        self.killed: list[RedisServer] = []  # masters killed by kill_master, in order

    @property
    def url(self) -> str:
        """The `redis+sentinel://` URL of the topology (every Sentinel, the master's name, db 0)."""
        if not self.sentinels:
            raise RuntimeError("the topology is not started")
        hosts = ",".join(f"127.0.0.1:{sentinel.port}" for sentinel in self.sentinels)
        scheme = "rediss+sentinel" if self.tls is not None else "redis+sentinel"
        return f"{scheme}://{hosts}/{self.master_name}/0"

    def start(self) -> RedisSentinel:
        """Start every node (a running topology is closed first) and wait until a failover could run."""
        self.close()
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            master = self._node(self._server().start())
            for _ in range(self.replica_count):
                self._node(self._server(("--replicaof", "127.0.0.1", str(master.port))).start())
            replicas = self.nodes[1:]
            _wait(lambda: all(self._info(node.port).get("master_link_status") == "up" for node in replicas),
                  deadline,
                  "a replica did not sync with the master")
            config = "\n".join([
                f"sentinel monitor {self.master_name} 127.0.0.1 {master.port} {self.quorum}",
                f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}",
                f"sentinel failover-timeout {self.master_name} {self.failover_timeout_ms}",
                f"sentinel parallel-syncs {self.master_name} 1",
                "",
            ])
            for _ in range(self.sentinel_count):
                sentinel = self._server(("--sentinel",), config=config)
                self.sentinels.append(sentinel)
                sentinel.start()
            _wait(self._sentinels_ready, deadline, "the Sentinels did not see the replicas and each other")
        except BaseException:
            self.close()
            raise
        return self

    def master_address(self) -> tuple[str, int] | None:
        """The master's address as the first Sentinel that answers names it (None: none answers)."""
        return next(self._named_masters(), None)

    @property
    def master(self) -> RedisServer:
        """The data node the Sentinels name as master."""
        address = self.master_address()
        for node in self.nodes:
            if address is not None and node.port == address[1]:
                return node
        raise RuntimeError("no Sentinel names a master of this topology")

    def kill_master(self) -> RedisServer:
        """SIGKILL the current master (what it acknowledged and did not yet replicate is lost)."""
        master = self.master
        master.stop()
        self.killed.append(master)
        return master

    def wait_for_failover(self, timeout_s: float = 15.0) -> RedisServer:
        """Wait until a majority of the Sentinels name a live master other than the last killed one and
        it takes writes (role master); return it."""
        if not self.killed:
            raise RuntimeError("no master was killed")
        old = self.killed[-1].port
        deadline = time.monotonic() + timeout_s
        promoted: list[RedisServer] = []

        def done() -> bool:
            named = [port for _, port in self._named_masters() if port != old]
            majority = len(self.sentinels) // 2 + 1
            for node in self.nodes:
                if (node.running and named.count(node.port) >= majority
                        and self._info(node.port).get("role") == "master"):
                    promoted[:] = [node]
                    return True
            return False

        _wait(done, deadline, f"no replica was promoted within {timeout_s:.0f} s")
        return promoted[0]

    def flush(self) -> None:
        """Empty the master (FLUSHALL, replicated), so a shared topology starts each test clean."""
        with self._client(self.master.port) as client:
            client.flushall()

    def close(self) -> None:
        """Kill every node (SIGKILL) and remove their temp dirs. Safe to call more than once."""
        for server in [*self.sentinels, *self.nodes]:
            server.close()
        self.sentinels, self.nodes, self.killed = [], [], []

    def __enter__(self) -> RedisSentinel:
        if not self.sentinels:
            self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _server(self, args: tuple[str, ...] = (), config: str | None = None) -> RedisServer:
        if self.tls is None:
            return RedisServer(binary=self.binary, config=config, args=args)
        port = free_port()
        return RedisServer(binary=self.binary, port=port, config=config, tls_ca=self.tls.ca,
                           args=(*self.tls.server_args(port), *args))

    def _client(self, port: int) -> redis.Redis:
        return node_client(port, **_tls_kwargs(self.tls))

    def _info(self, port: int) -> dict[str, str]:
        return node_info(port, **_tls_kwargs(self.tls))

    def _node(self, server: RedisServer) -> RedisServer:
        self.nodes.append(server)
        return server

    def _named_masters(self) -> Iterator[tuple[str, int]]:
        """The master's address as each live Sentinel that answers names it, one after another."""
        for sentinel in self.sentinels:
            if not sentinel.running:
                continue
            try:
                with self._client(sentinel.port) as client:
                    reply = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name)
            except redis.RedisError:
                continue
            if reply:
                yield str(reply[0]), int(reply[1])

    def _sentinels_ready(self) -> bool:
        for sentinel in self.sentinels:
            with self._client(sentinel.port) as client:
                state = client.execute_command("SENTINEL", "MASTER", self.master_name)
            fields = dict(zip(state[::2], state[1::2], strict=True)) if isinstance(state, list) else state
            if (int(fields.get("num-slaves", 0)) < self.replica_count
                    or int(fields.get("num-other-sentinels", 0)) < self.sentinel_count - 1):
                return False
        return True


def _tls_kwargs(tls: TLSFiles | None) -> dict[str, Any]:
    return tls.client_kwargs() if tls is not None else {}
