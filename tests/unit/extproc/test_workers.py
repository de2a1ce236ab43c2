"""`modeldock extproc --workers N` and `modeldock up --workers N`: validation, the ports and replica names each
worker gets, the supervisor's restarts and drain (fake children on a FakeClock), and the bootstrap `up` renders."""

from __future__ import annotations

import argparse
import signal
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import yaml

from modeldock.cli import build_parser, main
from modeldock.clock import FakeClock
from modeldock.config import Config, hash_key, parse_config
from modeldock.envoy import render_bootstrap
from modeldock.extproc.workers import (
    StartError,
    WorkerPool,
    WorkerSpec,
    plan_workers,
    replica_base,
    worker_command,
    worker_count,
)
from modeldock.up import extproc_command, free_ports, sharing_note, up_bootstrap

# --- validation -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["1", "2", "64"])
def test_a_worker_count_of_1_to_64_is_taken(text: str) -> None:
    assert worker_count(text) == int(text)


@pytest.mark.parametrize(("text", "message"), [("0", "must be 1-64, got 0"), ("65", "must be 1-64, got 65"),
                                               ("-3", "must be 1-64, got -3"), ("two", "an integer 1-64")])
def test_a_worker_count_out_of_range_is_refused_with_the_range(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        worker_count(text)


@pytest.mark.parametrize("command", [["extproc", "--config", "c.yaml"], ["up"]])
def test_the_cli_refuses_65_workers_naming_the_flag(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*command, "--workers", "65"])
    assert exit_info.value.code == 2
    assert "argument --workers: must be 1-64, got 65" in capsys.readouterr().err


def test_workers_default_to_one() -> None:
    assert build_parser().parse_args(["extproc", "--config", "c.yaml"]).workers == 1
    assert build_parser().parse_args(["up"]).workers == 1


# --- ports and replica names ----------------------------------------------------------------------------------

def test_each_worker_gets_the_next_port_metrics_port_and_its_own_replica_name() -> None:
    assert plan_workers(3, 18001, 9100, "pod-a") == [
        WorkerSpec(0, 18001, 9100, "pod-a-w0"),
        WorkerSpec(1, 18002, 9101, "pod-a-w1"),
        WorkerSpec(2, 18003, 9102, "pod-a-w2"),
    ]
    assert [s.metrics_port for s in plan_workers(2, 18001, None, "b")] == [None, None]


@pytest.mark.parametrize(("count", "port", "metrics", "message"), [
    (3, 65534, None, "needs ports 65534-65536, within 1-65535"),
    (2, 18001, 65535, "needs ports 65535-65536"),
    (4, 18001, 18003, "gRPC ports 18001-18004 and metrics ports 18003-18006 overlap"),
    (65, 18001, None, "must be 1-64"),
    (2, 0, None, "needs ports 0-1"),
])
def test_ports_that_cannot_hold_the_workers_are_refused(count: int, port: int, metrics: int | None,
                                                         message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_workers(count, port, metrics, "r")


def test_the_replica_base_is_the_environments_name_else_the_host_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert replica_base({"MODELDOCK_REPLICA": "gateway-7f9c"}) == "gateway-7f9c"
    monkeypatch.setattr(socket, "gethostname", lambda: "node-3")
    assert replica_base({}) == "node-3"


def test_a_workers_command_keeps_every_extproc_flag_but_its_ports_and_workers() -> None:
    argv = ["--log-level", "warning", "extproc", "--config", "c.yaml", "--xds", "10.0.0.5:18000", "--host",
            "0.0.0.0", "--port", "18001", "--metrics-port", "9100", "--metrics-host", "127.0.0.1", "--grace", "12",
            "--drain-delay", "3", "--picker", "list", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--workers", "4"]
    parent = build_parser().parse_args(argv)
    spec = plan_workers(4, parent.port, parent.metrics_port, "r")[2]
    cmd = worker_command(parent, spec)
    assert cmd[1:3] == ["-m", "modeldock"]
    child = build_parser().parse_args(cmd[3:])
    assert (child.port, child.metrics_port, child.workers) == (18003, 9102, 1)
    # A flag added to `extproc` and not passed on by worker_command shows here as a difference.
    differ = {k for k in vars(parent) if getattr(child, k) != getattr(parent, k)}
    assert differ == {"port", "metrics_port", "workers"}


# --- the supervisor ---------------------------------------------------------------------------------------------

class FakeChild:
    def __init__(self, pid: int, env: Mapping[str, str], drains: bool = True) -> None:
        self.pid, self.env, self.drains = pid, dict(env), drains
        self.code: int | None = None
        self.signals: list[int] = []
        self.killed = False

    def poll(self) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGTERM and self.drains:
            self.code = 0

    def kill(self) -> None:
        self.killed, self.code = True, -9


class Rig:
    def __init__(self, count: int = 2) -> None:
        self.clock = FakeClock()
        self.children: list[FakeChild] = []
        self.up: set[int] = set()  # ports "listening"
        self.drains = True
        self.pool = WorkerPool(plan_workers(count, 18001, None, "h"), lambda s: ["extproc", str(s.port)],
                               spawn=self.spawn, is_listening=lambda s: s.port in self.up, clock=self.clock)

    def spawn(self, cmd: Sequence[str], env: Mapping[str, str]) -> FakeChild:
        child = FakeChild(100 + len(self.children), env, self.drains)
        self.children.append(child)
        return child

    def current(self, index: int) -> FakeChild:
        proc = self.pool.workers[index].proc
        assert isinstance(proc, FakeChild)
        return proc


def test_each_child_gets_its_own_replica_name() -> None:
    rig = Rig(3)
    rig.pool.start_all()
    assert [c.env["MODELDOCK_REPLICA"] for c in rig.children] == ["h-w0", "h-w1", "h-w2"]


def test_a_child_that_dies_after_listening_is_restarted_after_a_doubling_backoff(
        caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig()
    rig.pool.start_all()
    rig.up = {18001, 18002}
    rig.pool.poll()
    assert rig.pool.all_listening()
    for failure, delay in ((1, 0.5), (2, 1.0), (3, 2.0)):
        first = rig.current(1)
        first.code = -9
        rig.pool.poll()
        assert rig.pool.workers[1].proc is None
        assert f"restarting in {delay:.1f}s (failure {failure})" in caplog.text
        rig.clock.advance(delay - 0.01)
        rig.pool.poll()
        assert rig.pool.workers[1].proc is None  # not before its backoff
        rig.clock.advance(0.01)
        rig.pool.poll()
        assert rig.current(1) is not first
        assert rig.current(1).env["MODELDOCK_REPLICA"] == "h-w1"  # the same replica, restarted
        rig.pool.poll()
    assert len(rig.children) == 5  # 2 first lives, 3 restarts of worker 1; worker 0 untouched
    assert rig.current(0) is rig.children[0]


def test_a_child_up_for_30s_has_its_failures_forgotten(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(1)
    rig.pool.start_all()
    rig.up = {18001}
    rig.pool.poll()
    for _ in range(2):
        rig.current(0).code = 1
        rig.pool.poll()
        rig.clock.advance(5)
        rig.pool.poll()
    rig.pool.poll()  # listening again
    rig.clock.advance(29.9)
    rig.pool.poll()
    assert rig.pool.workers[0].failures == 2
    rig.clock.advance(0.1)
    rig.pool.poll()
    rig.current(0).code = 1
    rig.pool.poll()
    assert "restarting in 0.5s (failure 1)" in caplog.text.splitlines()[-1]


def test_a_child_that_exits_before_it_ever_listened_is_a_start_failure() -> None:
    rig = Rig()
    rig.pool.start_all()
    rig.up = {18001}
    rig.pool.poll()
    rig.current(1).code = 2  # e.g. its port was taken
    with pytest.raises(StartError, match=r"worker 1 \(port 18002\) exited with 2 before it listened"):
        rig.pool.poll()


def test_a_spawn_that_fails_is_a_start_failure() -> None:
    def fail(cmd: Sequence[str], env: Mapping[str, str]) -> FakeChild:
        raise FileNotFoundError("no such interpreter")

    pool = WorkerPool(plan_workers(2, 18001, None, "h"), lambda s: ["x"], spawn=fail, is_listening=lambda s: False,
                      clock=FakeClock())
    with pytest.raises(StartError, match="cannot start worker 0: no such interpreter"):
        pool.start_all()


def test_stop_sends_sigterm_to_every_child_and_restarts_none() -> None:
    rig = Rig()
    rig.pool.start_all()
    rig.up = {18001, 18002}
    rig.pool.poll()
    rig.pool.stop(10, sleep=rig.clock.advance)
    assert [c.signals for c in rig.children] == [[signal.SIGTERM], [signal.SIGTERM]]
    assert not any(c.killed for c in rig.children)
    rig.clock.advance(60)
    rig.pool.poll()
    assert len(rig.children) == 2


def test_stop_kills_a_child_still_draining_at_the_deadline_and_not_before() -> None:
    rig = Rig()
    rig.drains = False
    rig.pool.start_all()
    start = rig.clock.monotonic()
    rig.pool.stop(7, sleep=rig.clock.advance)
    assert all(c.killed for c in rig.children)
    assert rig.clock.monotonic() - start == pytest.approx(7, abs=0.06)


# --- modeldock up --workers --------------------------------------------------------------------------------------

def _config(**limits: object) -> Config:
    return parse_config({"tenants": [{"id": "t", "api_key_hashes": [hash_key("k")], "models": ["*"]}],
                         "models": [{"name": "m", "endpoints": ["127.0.0.1:9"]}], "limits": limits})


def _extproc_ports(bootstrap: str) -> list[int]:
    clusters = {c["name"]: c for c in yaml.safe_load(bootstrap)["static_resources"]["clusters"]}
    endpoints = clusters["modeldock_extproc"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    return [e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints]


@pytest.mark.parametrize(("workers", "ports"), [(1, [21000]), (3, [21000, 21001, 21002])])
def test_ups_bootstrap_lists_every_worker_in_the_extproc_cluster(workers: int, ports: list[int]) -> None:
    options = up_bootstrap(_config(), 8080, 9901, 18000, 21000, workers)
    assert _extproc_ports(render_bootstrap(options)) == ports


def test_up_runs_the_supervisor_only_for_more_than_one_worker() -> None:
    one = extproc_command(["py"], Path("c.yaml"), 21000, 18000, 1)
    assert "--workers" not in one
    assert extproc_command(["py"], Path("c.yaml"), 21000, 18000, 4)[-2:] == ["--workers", "4"]


def test_ups_workers_drain_within_the_10s_up_gives_each_child_to_stop() -> None:
    # The supervisor kills a worker after drain delay + grace + 5 s; `up` kills the supervisor after 10 s,
    # and a worker outliving it would be left behind.
    args = build_parser().parse_args(extproc_command([], Path("c.yaml"), 21000, 18000, 2))
    assert args.drain_delay + args.grace + 5 < 10


def _config_file(tmp_path: Path) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"tenants": [{"id": "t", "api_key_hashes": [hash_key("k")], "models": ["*"]}],
                                    "models": [{"name": "m", "endpoints": ["127.0.0.1:9"]}]}))
    return path


def test_extproc_workers_refuses_ports_past_65535_before_starting_any(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["extproc", "--config", str(_config_file(tmp_path)), "--port", "65535", "--workers", "2"])
    assert code == 2
    assert "--port 65535 with --workers 2 needs ports 65535-65536" in capsys.readouterr().err


def test_extproc_workers_refuses_a_bad_config_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [{name: m, endpoints: ['nope:1']}]\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["extproc", "--config", str(bad), "--workers", "2"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.count("invalid config") == 1


def test_up_says_workers_share_only_through_redis_when_none_is_configured() -> None:
    plain = _config()
    note = sharing_note(2, plain, {})
    assert note is not None and "only through Redis" in note and "each sees only its own requests" in note
    assert sharing_note(1, plain, {}) is None
    assert sharing_note(2, plain, {"REDIS_URL": "redis://r:6379/0"}) is None
    assert sharing_note(2, _config(redis_url="redis://r:6379/0"), {}) is None


def test_free_ports_hands_out_a_block_of_consecutive_bindable_ports() -> None:
    first = free_ports(4)
    for port in range(first, first + 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert free_ports(4) not in range(first - 3, first + 4)  # not handed out twice
