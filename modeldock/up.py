"""`modeldock up`: the whole stack on one machine, supervised.

Starts simulated backends, the xDS server (static discovery), ext_proc and
Envoy as child processes on loopback. Every child dies with this process
(PR_SET_PDEATHSIG) and is stopped on Ctrl-C or SIGTERM, so none is left behind.
With `--workers N`, ext_proc is `modeldock extproc --workers N` (N processes on consecutive ports, one
supervisor) and Envoy's ext_proc cluster lists all N.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from modeldock.config import Config, ConfigError, hash_key, load_config, parse_config
from modeldock.envoy import BootstrapOptions, envoy_binary, render_bootstrap
from modeldock.process import die_with_parent
from modeldock.types import cluster_name

DEMO_MODEL = "demo-model"


# Ports handed to children come from below Linux's ephemeral range (32768-60999 by default): a port
# the kernel chose with bind(0) is the next one it hands to some outgoing connection, so a child
# could lose it between our check and its own bind. Here only another free_port() caller can race.
# A port handed out is not handed out again by this process (its child may not have bound it yet).
_PORT_LOW, _PORT_HIGH = 20000, 32000
_ports = random.Random()
_given: set[int] = set()


def free_port() -> int:
    """A loopback port that is free now, outside the ephemeral range, and new to this process."""
    for _ in range(200):
        port = _ports.randrange(_PORT_LOW, _PORT_HIGH)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            if len(_given) > (_PORT_HIGH - _PORT_LOW) // 2:
                _given.clear()  # a long-lived process: start over rather than run dry
            _given.add(port)
            return port
    with socket.socket() as s:  # the whole range is busy: take what the kernel gives
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> int:
    """The first of `count` consecutive loopback ports free now and new to this process (ext_proc workers)."""
    if count == 1:
        return free_port()
    for _ in range(200):
        first = _ports.randrange(_PORT_LOW, _PORT_HIGH - count)
        block = range(first, first + count)
        if _given.intersection(block) or not all(_bindable(p) for p in block):
            continue
        _given.update(block)
        return first
    raise OSError(f"no {count} consecutive free ports in {_PORT_LOW}-{_PORT_HIGH}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


_WORKER_GRACE = 4.0
_STOP_TIMEOUT = 10.0


def extproc_command(py: list[str], config_path: Path, port: int, xds_port: int, workers: int) -> list[str]:
    """`modeldock extproc` as `up` runs it: with `workers` > 1, the supervisor of ports port..port+workers-1."""
    cmd = [*py, "extproc", "--config", str(config_path), "--port", str(port), "--xds", f"127.0.0.1:{xds_port}"]
    if workers == 1:
        return cmd
    # The supervisor kills a worker still draining after grace + 5 s: with grace 4 that is within stop_all's
    # 10 s, so no worker outlives `up` (one process alone is simply killed at 10 s).
    return [*cmd, "--grace", str(_WORKER_GRACE), "--workers", str(workers)]


def up_bootstrap(config: Config, listen_port: int, admin_port: int, xds_port: int, extproc_port: int,
                 workers: int = 1) -> BootstrapOptions:
    """Envoy's options for `up`: every ext_proc worker a host of the ext_proc cluster."""
    endpoints = tuple(f"127.0.0.1:{extproc_port + i}" for i in range(workers)) if workers > 1 else ()
    return BootstrapOptions(
        listen_port=listen_port, admin_port=admin_port, xds_port=xds_port, extproc_port=extproc_port,
        extproc_endpoints=endpoints, buffer_limit=config.limits.max_body_bytes, listener=config.listener,
    )


def sharing_note(workers: int, config: Config, environ: Mapping[str, str]) -> str | None:
    """The line `up` prints when its workers see only their own requests (no Redis to share through)."""
    if workers <= 1 or config.limits.redis_url or environ.get("REDIS_URL"):
        return None
    return (f"modeldock: {workers} ext_proc workers share load state only through Redis (limits.redis_url or "
            "$REDIS_URL); without one, each sees only its own requests (rate limits, picker load)")


def demo_config(api_key: str, endpoints: list[str]) -> dict[str, object]:
    return {
        "tenants": [{"id": "demo", "api_key_hashes": [hash_key(api_key)], "models": ["demo-*"]}],
        "models": [{"name": DEMO_MODEL, "endpoints": endpoints}],
    }


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class Supervisor:
    run_dir: Path
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, cmd: list[str], env: Mapping[str, str] | None = None) -> Child:
        """Start `cmd` as a child that dies with this process, its output in `<run_dir>/<name>.log`;
        `env`: variables added to this process's environment."""
        log = self.run_dir / f"{name}.log"
        handle = open(log, "ab")  # noqa: SIM115 (the child owns it)
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT,
            env={**os.environ, **env} if env else None,
            preexec_fn=die_with_parent(),  # `modeldock up` killed: its children get SIGTERM
        )
        handle.close()
        child = Child(name, proc, log)
        self.children.append(child)
        return child

    def exited(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop_all(self, timeout: float = _STOP_TIMEOUT) -> None:
        # Front door first, so no new request arrives while the rest drains.
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.terminate()
                try:
                    child.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()


def _get(url: str, timeout: float = 1.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (loopback)
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def envoy_ready(admin: str, config: Config) -> bool:
    status, body = _get(f"{admin}/ready")
    if status != 200:
        return False
    status, body = _get(f"{admin}/clusters?format=json")
    if status != 200:
        return False
    clusters = {c["name"]: c.get("host_statuses", []) for c in json.loads(body).get("cluster_statuses", [])}
    # Every ext_proc replica has passed Envoy's gRPC health check (it is in sync with xDS).
    extproc = clusters.get("modeldock_extproc", [])
    if not extproc or any(h.get("health_status", {}).get(flag) for h in extproc
                          for flag in ("failed_active_health_check", "pending_active_hc")):
        return False
    # Two passes per replica: right after its first pass, Envoy was seen to send a whole
    # burst of streams to one replica (the e2e admission tests rely on an even spread).
    status, body = _get(f"{admin}/stats?filter=^cluster.modeldock_extproc.health_check.success$")
    passes = int(body.decode().rpartition(": ")[2] or 0) if status == 200 else 0
    if passes < 2 * len(extproc):
        return False
    return all(clusters.get(cluster_name(m.name)) for m in config.models)


class _Stop(Exception):
    pass


def run_up(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="modeldock-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-m", "modeldock"]
    sup = Supervisor(run_dir)
    started = time.monotonic()

    def on_signal(signum: int, _frame: object) -> None:
        raise _Stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    generated_key: str | None = None
    try:
        if args.config:
            config_path = Path(args.config).resolve()
            config = load_config(config_path)
        else:
            api_key = os.environ.get("MODELDOCK_API_KEY", "")
            if not api_key:
                api_key = generated_key = "md-" + secrets.token_urlsafe(24)
            sim_ports = [free_port() for _ in range(max(1, args.backends))]
            for i, port in enumerate(sim_ports):
                sup.start(f"sim-{i}", [*py, "sim", "--port", str(port), "--model", DEMO_MODEL,
                                       "--speed", str(args.speed)])
            data = demo_config(api_key, [f"127.0.0.1:{p}" for p in sim_ports])
            config = parse_config(data, "built-in demo config")
            config_path = run_dir / "config.yaml"
            config_path.write_text(yaml.safe_dump(data, sort_keys=False))
        workers: int = args.workers
        xds_port, extproc_port, admin_port = free_port(), free_ports(workers), free_port()
        note = sharing_note(workers, config, os.environ)
        if note:
            print(note, file=sys.stderr, flush=True)
        sup.start("xds", [*py, "xds", "--config", str(config_path), "--port", str(xds_port)])
        sup.start("extproc", extproc_command(py, config_path, extproc_port, xds_port, workers))
        bootstrap = run_dir / "envoy.yaml"
        bootstrap.write_text(render_bootstrap(up_bootstrap(config, args.port, admin_port, xds_port, extproc_port,
                                                           workers)))
        sup.start("envoy", [envoy_binary(), "-c", str(bootstrap), "--use-dynamic-base-id",
                            "--log-level", "warn", "--drain-time-s", "2"])
        admin = f"http://127.0.0.1:{admin_port}"
        deadline = time.monotonic() + args.ready_timeout
        while not envoy_ready(admin, config):
            dead = sup.exited()
            if dead is not None:
                print(f"modeldock: {dead.name} exited with {dead.proc.returncode}\n{_tail(dead.log)}", file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print(f"modeldock: Envoy not ready after {args.ready_timeout:.0f}s; logs in {run_dir}", file=sys.stderr)
                return 1
            time.sleep(0.1)
        base = f"http://127.0.0.1:{args.port}/v1"
        key_ref = generated_key or "$MODELDOCK_API_KEY"
        model = config.models[0].name
        print(f"modeldock is up in {time.monotonic() - started:.1f}s: {base}", flush=True)
        if generated_key:
            print(f"  API key for the demo tenant: {generated_key}  (set MODELDOCK_API_KEY to choose your own)")
        print("  try:")
        print(f"    curl -s {base}/chat/completions -H \"Authorization: Bearer {key_ref}\" "
              f"-H 'content-type: application/json' "
              f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}]}}'")
        print(f"  logs and generated config: {run_dir}")
        print("  Ctrl-C stops everything.", flush=True)
        while True:
            dead = sup.exited()
            if dead is not None:
                print(f"modeldock: {dead.name} exited with {dead.proc.returncode}; stopping\n{_tail(dead.log)}",
                      file=sys.stderr)
                return 1
            time.sleep(0.2)
    except _Stop:
        print("modeldock: stopping", file=sys.stderr, flush=True)
        return 0
    except ConfigError as exc:
        print(f"modeldock: invalid config\n{exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sup.stop_all()
