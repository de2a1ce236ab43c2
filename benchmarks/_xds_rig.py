"""The processes benchmarks/xds_latency.py runs: children that die with it, the fake API server here
or in its own process, and the xDS server wrapped to print when its store and cache change.

    .venv/bin/python -m benchmarks._xds_rig --api-child                    # ops as JSON lines on stdin
    .venv/bin/python -m benchmarks._xds_rig --serve CONFIG KUBECONFIG PORT  # prints store/cache/ready lines
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks._proc import cpu_seconds, thread_cpu
from modeldock.config import load_config
from modeldock.discovery.snapshot import Snapshot

ROOT = Path(__file__).resolve().parent.parent
# Children must not outlive this script, even if it is killed: PR_SET_PDEATHSIG survives execve.
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def child(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """A Python or Envoy child that gets SIGTERM when this process dies, however it dies."""
    return subprocess.Popen([sys.executable, "-c", _DIE_WITH_PARENT, *args], cwd=ROOT, **kwargs)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ---- the fake API server, here or in its own process ---------------------------------------------


def _no_check(_obj: dict[str, Any]) -> None:
    pass


class InlineApi:
    """A FakeKubeServer in this process; `cpu` is its loop thread's. Each op is also a child command."""

    def __init__(self) -> None:
        from tests.support import fake_kube

        self._module, self._strict = fake_kube, fake_kube.validate
        self.server = fake_kube.FakeKubeServer()
        self.port, self.pid = self.server.port, os.getpid()

    def op(self, name: str, *args: Any) -> Any:
        if name == "apply":
            t0 = time.time()
            self.server.apply(args[0])
            return t0
        if name == "apply_many":
            return self.server.apply_many(args[0])
        if name == "strict":
            # The fake validates every object against the official schema, 50-70 ms per apply: a test-only
            # cost. Slices are validated when built, before t0; the fake's own check is off while timing.
            check: Any = self._strict if args[0] else _no_check
            self._module.validate = check
            return None
        if name == "kubeconfig":
            return str(self.server.write_kubeconfig(args[0]))
        return {"watches": lambda: self.server.open_watches, "port": lambda: self.port}[name]()

    def cpu(self) -> float:
        return thread_cpu("fake-kube")

    def close(self) -> None:
        self.op("strict", True)
        self.server.close()


class ProcessApi:
    """The same in its own process (`--api-child`): each op a JSON line on its stdin, answered on stdout."""

    def __init__(self) -> None:
        self.proc = child([sys.executable, "-m", "benchmarks._xds_rig", "--api-child"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.pid = self.proc.pid
        self.port = int(self.op("port"))

    def op(self, name: str, *args: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([name, *args]).encode() + b"\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the API process exited (rc {self.proc.poll()}) during {name}")
        return json.loads(line)

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def close(self) -> None:
        stop([self.proc])


def api_child() -> None:
    api = InlineApi()
    try:
        for line in sys.stdin:
            print(json.dumps(api.op(*json.loads(line))), flush=True)
    finally:
        api.close()


# ---- the xDS server process ----------------------------------------------------------------------


async def serve_child(config_path: str, kubeconfig: str, port: int) -> None:
    """The xDS server, printing `store <model> <time>` and `cache <time>` as they change."""
    import signal

    from modeldock.xds.app import XdsOptions, XdsServer

    config = load_config(config_path)
    server = XdsServer(config, XdsOptions(Path(config_path), port=port, kubeconfig=kubeconfig))
    seen: dict[str, tuple[object, ...]] = {}

    def on_store(snapshot: Snapshot) -> None:
        now = time.time()
        for model, entry in snapshot.models.items():
            before = seen.get(model)
            if before is not entry.endpoints and before != entry.endpoints:
                seen[model] = entry.endpoints
                print(f"store {model} {now:.6f}", flush=True)

    # Subscribed before start(): runs before the server's own rebuild hook on every swap.
    server.store.subscribe(on_store)
    server.cache.add_listener(lambda: print(f"cache - {time.time():.6f}", flush=True))
    await server.start()
    print(f"ready - {time.time():.6f}", flush=True)
    done = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, done.set)
    await done.wait()
    await server.stop(0)


@dataclass
class ChildLog:
    """What the xDS server process printed, with a condition to wait on."""

    lines: list[tuple[str, str, float]] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def follow(self, stream: object) -> None:
        for raw in stream:  # type: ignore[attr-defined]
            parts = raw.decode().split()
            if len(parts) == 3 and parts[0] in ("store", "cache", "ready"):
                with self.cond:
                    self.lines.append((parts[0], parts[1], float(parts[2])))
                    self.cond.notify_all()

    def ready(self) -> bool:
        with self.cond:
            return any(kind == "ready" for kind, _, _ in self.lines)

    def first_after(self, kind: str, model: str, after: float, timeout: float = 10.0) -> float:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for k, m, t in self.lines:
                    if k == kind and (model == "-" or m == model) and t >= after:
                        return t
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no {kind} line for {model} after {after}")
                self.cond.wait(remaining)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", nargs=3, metavar=("CONFIG", "KUBECONFIG", "PORT"))
    parser.add_argument("--api-child", action="store_true")
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve_child(args.serve[0], args.serve[1], int(args.serve[2])))
    elif args.api_child:
        api_child()
    else:
        parser.error("--serve or --api-child")


if __name__ == "__main__":
    main()
