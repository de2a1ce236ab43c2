"""The real stack on this machine, for end-to-end tests and benchmarks: simulators, xDS, ext_proc, Envoy.

Every process is a child of the caller under `modeldock up`'s `Supervisor` (it dies with the caller,
PR_SET_PDEATHSIG); `running_stack` stops them all on exit, and `Stack.stop` does it earlier.
"""

from __future__ import annotations

import functools
import os

# Set before anything imports grpc: children are started with a preexec_fn while the caller may hold live
# gRPC state, and gRPC's fork handlers then sometimes abort the child between fork and exec.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import json  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import urllib.request  # noqa: E402
from collections.abc import Callable, Iterator, Mapping, Sequence  # noqa: E402
from contextlib import ExitStack, contextmanager  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import yaml  # noqa: E402

from modeldock.config import Config, hash_key, parse_config  # noqa: E402
from modeldock.envoy import BootstrapOptions, envoy_binary, render_bootstrap  # noqa: E402
from modeldock.up import Supervisor, envoy_ready, free_port  # noqa: E402

PY = [sys.executable, "-m", "modeldock"]
API_KEY = "md-test-key-0123456789"
OTHER_KEY = "md-other-tenant-key-987"


def http_json(method: str, url: str, payload: object | None = None, timeout: float = 5.0) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (loopback)
        body = resp.read()
    return json.loads(body) if body else None


def wait_until(predicate: Callable[[], object], timeout: float = 15.0, interval: float = 0.05,
               what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Sim:
    port: int
    name: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def requests(self) -> list[dict[str, Any]]:
        requests: list[dict[str, Any]] = http_json("GET", f"{self.url}/sim/requests")
        return requests

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = http_json("GET", f"{self.url}/sim/stats")
        return stats

    def fault(self, mode: str, **kwargs: Any) -> None:
        http_json("POST", f"{self.url}/sim/fault", {"mode": mode, **kwargs})

    def token_counters(self) -> tuple[int, int]:
        """(prompt, generation) tokens this simulator counted, from its own /metrics (vLLM's names)."""
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=2).read().decode()  # noqa: S310
        prompt = generation = 0
        for line in text.splitlines():
            if line.startswith("vllm:prompt_tokens_total"):
                prompt += int(float(line.rsplit(" ", 1)[1]))
            elif line.startswith("vllm:generation_tokens_total"):
                generation += int(float(line.rsplit(" ", 1)[1]))
        return prompt, generation

    def healthy(self) -> bool:
        try:
            urllib.request.urlopen(f"{self.url}/health", timeout=0.5).read()  # noqa: S310
            return True
        except OSError:
            return False


@dataclass
class Stack:
    run_dir: Path
    sup: Supervisor
    port: int
    admin_port: int
    extproc_metrics_port: int
    xds_metrics_port: int
    config_path: Path
    sims: list[Sim] = field(default_factory=list)
    # One entry per ext_proc replica; replica 0 is `extproc_metrics_port` and logs to extproc.log.
    extproc_metrics_ports: list[int] = field(default_factory=list)
    extproc_ports: list[int] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def openai(self, api_key: str = API_KEY, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=api_key, max_retries=0, **kwargs)

    def metric(self, name: str, port: int | None = None) -> float:
        """Sum of a Prometheus metric's samples from ext_proc (or another port)."""
        url = f"http://127.0.0.1:{port or self.extproc_metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=2).read().decode()  # noqa: S310
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and (line[len(name)] in " {"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def metric_per_replica(self, name: str) -> list[float]:
        """The metric's sum on each ext_proc replica, in replica order."""
        return [self.metric(name, port) for port in self.extproc_metrics_ports or [self.extproc_metrics_port]]

    def in_flight(self) -> float:
        """Requests counted in flight, summed over every ext_proc replica."""
        return sum(self.metric_per_replica("modeldock_in_flight"))

    def leave_mid_stream(self, messages: Any, max_tokens: int, chunks: int = 3) -> None:
        """Stream a long completion with the openai client, read `chunks` content chunks, check
        the request is counted in flight, and close: a client that leaves mid-stream."""
        stream = self.openai().chat.completions.create(model="demo-model", messages=messages,
                                                       max_tokens=max_tokens, stream=True)
        try:
            got = 0
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    got += 1
                    if got == chunks:
                        break
            assert got == chunks, "the stream ended before the client left"
            assert self.in_flight() == 1
        finally:
            stream.close()  # a failed check does not leave a long stream running into the next test

    def envoy_stat(self, name: str) -> int:
        text = urllib.request.urlopen(f"{self.admin_url}/stats?filter=^{name}$", timeout=2).read().decode()  # noqa: S310
        return sum(int(line.split(": ", 1)[1]) for line in text.splitlines() if ": " in line)

    def stop(self) -> None:
        self.sup.stop_all(timeout=5)

    def kill(self) -> None:
        """SIGKILL every process of this stack (a crashed replica: no drain, no goodbye), and reap them.
        Simulators shared with other stacks (`running_stack(sims=...)`) belong to their owner and live on."""
        for child in self.sup.children:
            if child.proc.poll() is None:
                child.proc.kill()
        for child in self.sup.children:
            child.proc.wait(timeout=10)


def default_config(sims: Sequence[Sim]) -> dict[str, Any]:
    return {
        "tenants": [
            {"id": "acme", "api_key_hashes": [hash_key(API_KEY)], "models": ["demo-*"]},
            {"id": "other", "api_key_hashes": [hash_key(OTHER_KEY)], "models": ["other-model"]},
        ],
        "models": [
            {"name": "demo-model", "endpoints": [s.address for s in sims]},
            {"name": "other-model", "endpoints": [s.address for s in sims]},
        ],
    }


def start_sims(sup: Supervisor, count: int, sim_args: Sequence[str] = (), model: str = "demo-model") -> list[Sim]:
    sims = []
    for i in range(count):
        port = free_port()
        sup.start(f"sim-{port}", [*PY, "sim", "--port", str(port), "--model", model, *sim_args])
        sims.append(Sim(port, f"sim-{i}"))
    def healthy(sim: Sim) -> bool:
        dead = sup.exited()
        if dead is not None:
            raise AssertionError(f"{dead.name} exited early:\n{dead.log.read_text()[-3000:]}")
        return sim.healthy()

    for sim in sims:
        wait_until(functools.partial(healthy, sim), 20, what=f"simulator on {sim.port}")
    return sims


@contextmanager
def running_stack(
    run_dir: Path,
    *,
    backends: int = 2,
    sim_args: Sequence[str] = ("--speed", "20"),
    config: dict[str, Any] | None = None,
    edit_config: Callable[[dict[str, Any], list[Sim]], object] | None = None,
    xds_args: Sequence[str] = (),
    extproc_replicas: int = 1,
    extproc_env: Mapping[str, str] | None = None,
    extproc_args: Sequence[str] = (),
    log_level: str = "debug",
    envoy_config: Callable[[Stack], str] | None = None,
    sims: Sequence[Sim] | None = None,
) -> Iterator[Stack]:
    """`xds_args` are appended to the `modeldock xds` command line (e.g. `--kubeconfig PATH`).

    `envoy_config`: Envoy runs the bootstrap it returns for the stack's ports instead of modeldock's, and the
    stack is ready once Envoy says /ready and ext_proc is synced (tests/support/stack.py's mesh configs).

    `extproc_replicas` ext_proc processes run behind the one Envoy (replica 0 logs to extproc.log,
    replica i to extproc-i.log); `extproc_env` is added to their environment (e.g. REDIS_URL).

    `sims`: run in front of these simulators (already started by the caller, who owns them) instead of
    starting `backends` new ones; several stacks can then share one pool (`replica_stacks`).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    sup = Supervisor(run_dir)
    try:
        sims = list(sims) if sims is not None else start_sims(sup, backends, sim_args)
        data = config if config is not None else default_config(sims)
        if edit_config is not None:
            edit_config(data, sims)
        config_path = run_dir / "config.yaml"
        config_path.write_text(yaml.safe_dump(data, sort_keys=False))
        parsed = parse_config(data)
        xds_port, admin_port, port = free_port(), free_port(), free_port()
        xm = free_port()
        extproc_ports = [free_port() for _ in range(max(1, extproc_replicas))]
        metrics_ports = [free_port() for _ in extproc_ports]
        sup.start("xds", [*PY, "--log-level", log_level, "xds", "--config", str(config_path), "--port", str(xds_port),
                          "--metrics-port", str(xm), *xds_args])
        for i, (extproc_port, em) in enumerate(zip(extproc_ports, metrics_ports, strict=True)):
            name = "extproc" if i == 0 else f"extproc-{i}"
            # Each replica its own usage-record file (usage.<replica>.jsonl), as pods would have.
            replica_env = {**(extproc_env or {}), "MODELDOCK_REPLICA": name} if extproc_replicas > 1 else extproc_env
            sup.start(name, [*PY, "--log-level", log_level, "extproc", "--config", str(config_path),
                             "--port", str(extproc_port), "--xds", f"127.0.0.1:{xds_port}",
                             "--metrics-port", str(em), "--grace", "2", *extproc_args], replica_env)
        stack = Stack(run_dir, sup, port, admin_port, metrics_ports[0], xm, config_path, sims,
                      extproc_metrics_ports=metrics_ports, extproc_ports=extproc_ports)
        bootstrap = run_dir / "envoy.yaml"
        if envoy_config is not None:
            bootstrap.write_text(envoy_config(stack))
        else:
            bootstrap.write_text(render_bootstrap(BootstrapOptions(
                listen_port=port, admin_port=admin_port, xds_port=xds_port, extproc_port=extproc_ports[0],
                extproc_endpoints=tuple(f"127.0.0.1:{p}" for p in extproc_ports) if len(extproc_ports) > 1 else (),
                buffer_limit=parsed.limits.max_body_bytes, listener=parsed.listener)))
        sup.start("envoy", [envoy_binary(), "-c", str(bootstrap), "--use-dynamic-base-id", "--log-level", "warn",
                            "--drain-time-s", "1", "--file-flush-interval-msec", "20"])  # the access log, at once
        envoy_only = envoy_config is not None
        wait_until(lambda: _ready(stack, parsed, envoy_only=envoy_only), 30, what="Envoy clusters ready")
        yield stack
    finally:
        sup.stop_all(timeout=5)


@dataclass
class Replicas:
    """Whole gateway stacks in front of one shared pool of simulators (`replica_stacks`)."""

    sims: list[Sim]
    stacks: list[Stack]
    sims_sup: Supervisor


@contextmanager
def replica_stacks(
    run_dir: Path,
    *,
    replicas: int,
    backends: int = 2,
    sim_args: Sequence[str] = ("--speed", "20"),
    edit_config: Callable[[dict[str, Any], list[Sim]], object] | None = None,
    redis_url: str | None = None,
    log_level: str = "debug",
) -> Iterator[Replicas]:
    """`replicas` whole stacks (each its own xDS, ext_proc and Envoy on its own ports, as pods would be)
    in front of ONE set of `backends` simulators. Stack i runs in run_dir/r<i> with MODELDOCK_REPLICA=r<i>;
    with `redis_url`, every stack's config gets `limits.redis_url` (after `edit_config`). The simulators
    start first and stop last, so a stack killed mid-run (`Stack.kill`) leaves the pool serving the rest."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    run_dir.mkdir(parents=True, exist_ok=True)
    sims_sup = Supervisor(run_dir)
    try:
        sims = start_sims(sims_sup, backends, sim_args)

        def edit(data: dict[str, Any], given: list[Sim]) -> None:
            if edit_config is not None:
                edit_config(data, given)
            if redis_url is not None:
                data.setdefault("limits", {})["redis_url"] = redis_url

        with ExitStack() as stacks:
            started = [stacks.enter_context(running_stack(
                run_dir / f"r{i}", sims=sims, edit_config=edit, log_level=log_level,
                extproc_env={"MODELDOCK_REPLICA": f"r{i}"})) for i in range(replicas)]
            yield Replicas(sims, started, sims_sup)
    finally:
        sims_sup.stop_all(timeout=5)


def _envoy_up(admin_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{admin_url}/ready", timeout=1) as resp:  # noqa: S310
            return bool(resp.status == 200)
    except OSError:
        return False


def _ready(stack: Stack, parsed: Config, envoy_only: bool = False) -> bool:
    dead = stack.sup.exited()
    if dead is not None:
        raise AssertionError(f"{dead.name} exited early:\n{dead.log.read_text()[-3000:]}")
    envoy = _envoy_up(stack.admin_url) if envoy_only else envoy_ready(stack.admin_url, parsed)
    return envoy and all(_extproc_ready(stack, i) for i in range(len(stack.extproc_ports)))


def _extproc_ready(stack: Stack, replica: int) -> bool:
    """The replica accepts gRPC connections and has learned endpoints over ADS (Envoy's readiness
    says nothing about ext_proc, which may still be importing on a busy machine)."""
    try:
        with socket.create_connection(("127.0.0.1", stack.extproc_ports[replica]), timeout=0.5):
            pass
        url = f"http://127.0.0.1:{stack.extproc_metrics_ports[replica]}/metrics"
        text = urllib.request.urlopen(url, timeout=2).read().decode()  # noqa: S310
    except OSError:
        return False
    return "modeldock_picker_in_flight{" in text
