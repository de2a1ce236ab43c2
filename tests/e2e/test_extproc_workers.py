"""`modeldock extproc --workers 2` behind a real Envoy: both workers serve, a killed one comes back on its port,
and SIGTERM to the supervisor stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from modeldock.config import parse_config
from modeldock.envoy import BootstrapOptions, envoy_binary, render_bootstrap
from modeldock.up import Supervisor, envoy_ready, free_port, free_ports
from tests.e2e.test_up import alive, descendants
from tests.support.stack import API_KEY, PY, default_config, start_sims, wait_until

pytestmark = pytest.mark.e2e


def requests_total(metrics_port: int) -> float:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).read().decode()  # noqa: S310
    except OSError:
        return -1.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("modeldock_requests_total{"))


def test_two_workers_both_serve_restart_and_stop_leaving_nothing(tmp_path: Path) -> None:
    import openai

    sup = Supervisor(tmp_path)
    workers: subprocess.Popen[bytes] | None = None
    try:
        sims = start_sims(sup, 1, ("--speed", "50"))
        data = default_config(sims)
        config_path = tmp_path / "config.yaml"
        config_path.write_text(yaml.safe_dump(data, sort_keys=False))
        xds_port, admin_port, port = free_port(), free_port(), free_port()
        grpc_port, metrics_port = free_ports(2), free_ports(2)
        sup.start("xds", [*PY, "xds", "--config", str(config_path), "--port", str(xds_port)])
        log = open(tmp_path / "workers.log", "ab")  # noqa: SIM115 (the child owns it)
        workers = subprocess.Popen(
            [*PY, "extproc", "--config", str(config_path), "--port", str(grpc_port), "--xds",
             f"127.0.0.1:{xds_port}", "--metrics-port", str(metrics_port), "--grace", "2", "--workers", "2"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "MODELDOCK_REPLICA": "e2e"})
        log.close()
        bootstrap = tmp_path / "envoy.yaml"
        bootstrap.write_text(render_bootstrap(BootstrapOptions(
            listen_port=port, admin_port=admin_port, xds_port=xds_port, extproc_port=grpc_port,
            extproc_endpoints=(f"127.0.0.1:{grpc_port}", f"127.0.0.1:{grpc_port + 1}"))))
        sup.start("envoy", [envoy_binary(), "-c", str(bootstrap), "--use-dynamic-base-id", "--log-level", "warn",
                            "--drain-time-s", "1"])
        parsed = parse_config(data)
        wait_until(lambda: workers.poll() is None and envoy_ready(f"http://127.0.0.1:{admin_port}", parsed), 40,
                   what="Envoy ready with both workers healthy")
        worker_pids = descendants(workers.pid)
        assert len(worker_pids) == 2, worker_pids
        env_of = {pid: Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") for pid in worker_pids}
        assert sorted(e for envs in env_of.values() for e in envs if e.startswith(b"MODELDOCK_REPLICA=")) == [
            b"MODELDOCK_REPLICA=e2e-w0", b"MODELDOCK_REPLICA=e2e-w1"]

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=10)
        for _ in range(20):
            reply = client.chat.completions.create(model="demo-model", max_tokens=2,
                                                   messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].message.content
        counts = [requests_total(metrics_port), requests_total(metrics_port + 1)]
        assert all(c > 0 for c in counts) and sum(counts) >= 20, counts

        # A worker killed outright is restarted on its own port, and serves again.
        victim = next(pid for pid in worker_pids
                      if f"--port\0{grpc_port + 1}\0".encode() in Path(f"/proc/{pid}/cmdline").read_bytes())
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: requests_total(metrics_port + 1) == 0.0, 20, what="worker 1 restarted (a fresh count)")
        wait_until(lambda: envoy_ready(f"http://127.0.0.1:{admin_port}", parsed), 30, what="worker 1 healthy again")

        def served_by_restarted() -> bool:
            try:  # Envoy may still try the dead worker once before its health check sees it gone
                client.chat.completions.create(model="demo-model", max_tokens=2,
                                               messages=[{"role": "user", "content": "hi"}])
            except openai.APIError:
                return False
            return requests_total(metrics_port + 1) > 0
        wait_until(served_by_restarted, 20, interval=0, what="the restarted worker serving")
        assert "exited unexpectedly with -9; restarting in 0.5s" in (tmp_path / "workers.log").read_text()

        everything = descendants(workers.pid)
        workers.send_signal(signal.SIGTERM)
        assert workers.wait(30) == 0
        time.sleep(0.2)
        assert not [pid for pid in everything if alive(pid)], "workers left behind"
    finally:
        if workers is not None and workers.poll() is None:
            workers.kill()
            workers.wait(10)
        sup.stop_all(timeout=5)


def test_up_with_two_workers_spreads_requests_over_both_and_stops_leaving_nothing(tmp_path: Path) -> None:
    import openai

    port = free_port()
    proc = subprocess.Popen(
        [*PY, "up", "--port", str(port), "--backends", "1", "--speed", "50", "--workers", "2",
         "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**{k: v for k, v in os.environ.items() if k != "REDIS_URL"}, "MODELDOCK_API_KEY": "md-e2e-workers"})
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (lines and lines[-1].startswith("  Ctrl-C")):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        output = "".join(lines)
        assert "Ctrl-C" in output, output
        assert "2 ext_proc workers share load state only through Redis" in output
        bootstrap = yaml.safe_load((tmp_path / "run" / "envoy.yaml").read_text())
        admin = bootstrap["admin"]["address"]["socket_address"]["port_value"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="md-e2e-workers", max_retries=0,
                               timeout=10)
        for _ in range(20):
            client.chat.completions.create(model="demo-model", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}])
        text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/clusters", timeout=2).read().decode()  # noqa: S310
        # Envoy's count of ext_proc streams per worker (the health checks are not counted in rq_total).
        streams = {line.split("::")[1]: int(line.rsplit("::", 1)[1]) for line in text.splitlines()
                   if line.startswith("modeldock_extproc::") and "::rq_total::" in line}
        assert len(streams) == 2 and all(n > 0 for n in streams.values()), streams
        everything = descendants(proc.pid)
        assert len(everything) >= 6  # a simulator, xDS, the supervisor and its 2 workers, Envoy
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0
    time.sleep(0.2)
    assert not [pid for pid in everything if alive(pid)], "processes left behind"
