"""`modeldock extproc --workers N`: N ext_proc processes on one machine, supervised.

One Python process serves ext_proc on one core. With `--workers N` this process starts N children,
each a plain `modeldock extproc` on its own port (port..port+N-1, metrics metrics_port..+N-1) with its
own `MODELDOCK_REPLICA` (`<base>-w<i>`), so they are replicas exactly as separate pods are: Envoy
balances streams across the N hosts of its ext_proc cluster, and they share load state only through
Redis. This process serves nothing itself. It forwards SIGTERM/SIGINT to every child (each drains as
it would alone), the children die with it (PR_SET_PDEATHSIG), and a child that dies unexpectedly
after it once listened is restarted after a backoff (0.5 s doubling to 30 s, reset after 30 s up).
A child that exits before it ever listened (a taken port, a bad flag) stops them all: exit 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from modeldock.clock import Clock, SystemClock
from modeldock.process import die_with_parent

log = logging.getLogger("modeldock.extproc.workers")

MAX_WORKERS = 64
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 30.0
STABLE_SECONDS = 30.0  # a child up this long has its failure count forgotten
POLL_SECONDS = 0.2


def worker_count(text: str) -> int:
    """argparse type of `--workers`: an integer 1-64."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer 1-{MAX_WORKERS}, got {text!r}") from None
    if not 1 <= value <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be 1-{MAX_WORKERS}, got {value}")
    return value


@dataclass(frozen=True)
class WorkerSpec:
    index: int
    port: int
    metrics_port: int | None
    replica: str  # MODELDOCK_REPLICA: names its usage files and its share of the replicas' load state


def replica_base(environ: Mapping[str, str]) -> str:
    return environ.get("MODELDOCK_REPLICA") or socket.gethostname() or "extproc"


def plan_workers(count: int, port: int, metrics_port: int | None, base: str) -> list[WorkerSpec]:
    """One spec per worker, or ValueError saying why these ports cannot hold `count` workers."""
    if not 1 <= count <= MAX_WORKERS:
        raise ValueError(f"--workers must be 1-{MAX_WORKERS}, got {count}")
    grpc = range(port, port + count)
    if port < 1 or grpc[-1] > 65535:
        raise ValueError(f"--port {port} with --workers {count} needs ports {port}-{grpc[-1]}, within 1-65535")
    if metrics_port is not None:
        metrics = range(metrics_port, metrics_port + count)
        if metrics_port < 1 or metrics[-1] > 65535:
            raise ValueError(f"--metrics-port {metrics_port} with --workers {count} needs ports "
                             f"{metrics_port}-{metrics[-1]}, within 1-65535")
        if set(grpc) & set(metrics):
            raise ValueError(f"gRPC ports {port}-{grpc[-1]} and metrics ports {metrics_port}-{metrics[-1]} overlap")
    return [WorkerSpec(i, port + i, None if metrics_port is None else metrics_port + i, f"{base}-w{i}")
            for i in range(count)]


def worker_command(args: argparse.Namespace, spec: WorkerSpec) -> list[str]:
    """The child's command line: this process's extproc flags, its own ports, no --workers."""
    cmd = [sys.executable, "-m", "modeldock", "--log-level", args.log_level, "extproc",
           "--config", args.config, "--xds", args.xds, "--host", args.host, "--port", str(spec.port),
           "--grace", str(args.grace), "--drain-delay", str(args.drain_delay)]
    optional = {"--metrics-port": spec.metrics_port, "--metrics-host": args.metrics_host, "--picker": args.picker,
                "--tls-cert": args.tls_cert, "--tls-key": args.tls_key}
    for flag, value in optional.items():
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def backoff(failures: int) -> float:
    """Seconds before restarting a child that has failed `failures` times in a row (>= 1)."""
    return float(min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (failures - 1)))


class Proc(Protocol):
    pid: int

    def poll(self) -> int | None: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


Spawn = Callable[[Sequence[str], Mapping[str, str]], Proc]


def spawn_child(cmd: Sequence[str], env: Mapping[str, str]) -> Proc:
    # Output goes where ours goes; the child shares our process group, so a terminal's Ctrl-C reaches it too.
    return subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, env={**os.environ, **env},
                            preexec_fn=die_with_parent())


def listening(host: str, port: int) -> bool:
    target = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host.strip("[]"))
    try:
        with socket.create_connection((target, port), timeout=0.2):
            return True
    except OSError:
        return False


class StartError(Exception):
    pass


@dataclass
class _Worker:
    spec: WorkerSpec
    proc: Proc | None = None
    started_at: float = 0.0
    ever_listened: bool = False  # in any life: only a worker that once served is restarted
    listening: bool = False  # in this life
    failures: int = 0
    restart_at: float | None = None


class WorkerPool:
    """The children and their restarts; `poll()` is called every POLL_SECONDS by `run_workers`."""

    def __init__(self, specs: Sequence[WorkerSpec], command: Callable[[WorkerSpec], list[str]], *,
                 spawn: Spawn = spawn_child, is_listening: Callable[[WorkerSpec], bool] | None = None,
                 clock: Clock | None = None) -> None:
        self.workers = [_Worker(s) for s in specs]
        self._command = command
        self._spawn = spawn
        self._is_listening = is_listening or (lambda s: listening("127.0.0.1", s.port))
        self._clock = clock or SystemClock()
        self.stopping = False

    def _start(self, worker: _Worker) -> None:
        try:
            worker.proc = self._spawn(self._command(worker.spec), {"MODELDOCK_REPLICA": worker.spec.replica})
        except OSError as exc:
            raise StartError(f"cannot start worker {worker.spec.index}: {exc}") from exc
        worker.started_at, worker.listening, worker.restart_at = self._clock.monotonic(), False, None
        log.info("worker %d (%s) started: pid %d, port %d", worker.spec.index, worker.spec.replica,
                 worker.proc.pid, worker.spec.port)

    def start_all(self) -> None:
        for worker in self.workers:
            self._start(worker)

    def all_listening(self) -> bool:
        return all(w.listening for w in self.workers)

    def poll(self) -> None:
        """Notice children listening and children gone; restart those due. StartError: one never came up."""
        now = self._clock.monotonic()
        for w in self.workers:
            if w.proc is None:
                if w.restart_at is not None and now >= w.restart_at and not self.stopping:
                    self._start(w)
                continue
            code = w.proc.poll()
            if code is None:
                if not w.listening and self._is_listening(w.spec):
                    w.listening = w.ever_listened = True
                if w.listening and w.failures and now - w.started_at >= STABLE_SECONDS:
                    w.failures = 0
                continue
            w.proc = None
            if self.stopping:
                continue
            if not w.ever_listened:
                raise StartError(f"worker {w.spec.index} (port {w.spec.port}) exited with {code} before it listened")
            w.failures += 1
            delay = backoff(w.failures)
            w.restart_at = now + delay
            log.warning("worker %d (%s, port %d) exited unexpectedly with %s; restarting in %.1fs (failure %d)",
                        w.spec.index, w.spec.replica, w.spec.port, code, delay, w.failures)

    def signal_all(self, sig: int) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(sig)

    def stop(self, timeout: float, sleep: Callable[[float], None] = time.sleep) -> None:
        """SIGTERM to every child (each drains), SIGKILL to any still there after `timeout` seconds."""
        self.stopping = True
        self.signal_all(signal.SIGTERM)
        deadline = self._clock.monotonic() + timeout
        while any(w.proc is not None and w.proc.poll() is None for w in self.workers):
            if self._clock.monotonic() >= deadline:
                for w in self.workers:
                    if w.proc is not None and w.proc.poll() is None:
                        log.warning("worker %d did not drain in %.0fs: killed", w.spec.index, timeout)
                        w.proc.kill()
                break
            sleep(0.05)


def run_workers(args: argparse.Namespace) -> int:
    """The supervisor's process: start, watch and restart the workers until SIGTERM/SIGINT."""
    try:
        specs = plan_workers(args.workers, args.port, args.metrics_port, replica_base(os.environ))
    except ValueError as exc:
        print(f"modeldock extproc: {exc}", file=sys.stderr)
        return 2
    pool = WorkerPool(specs, lambda s: worker_command(args, s),
                      is_listening=lambda s: listening(args.host, s.port))
    stop_requested: list[int] = []

    # A flag, not an exception: a signal mid-start must not leave a child the pool does not know.
    def on_signal(signum: int, _frame: object) -> None:
        stop_requested.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    announced = False
    try:
        pool.start_all()
        while not stop_requested:
            pool.poll()
            if not announced and pool.all_listening():
                announced = True
                log.info("%d ext_proc workers listening on ports %d-%d", len(specs), specs[0].port, specs[-1].port)
            time.sleep(POLL_SECONDS)
        log.info("stopping %d ext_proc workers", len(specs))
        return 0
    except StartError as exc:
        print(f"modeldock extproc: {exc}; stopping the workers", file=sys.stderr, flush=True)
        return 1
    finally:
        # Each child drains for up to its drain delay plus its grace; a margin for its last usage reports.
        pool.stop(args.drain_delay + args.grace + 5.0)
