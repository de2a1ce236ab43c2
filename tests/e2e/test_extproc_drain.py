"""Draining one of several ext_proc replicas loses no request: it reports NOT_SERVING
over grpc.health.v1, Envoy's active health check stops opening streams to it, and only
then does it stop taking new ones."""

from __future__ import annotations

import signal
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.stack import Stack, running_stack, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("drain"), backends=1, extproc_replicas=2,
                       extproc_args=("--drain-delay", "3"), sim_args=("--speed", "50")) as s:
        yield s


def extproc_hosts(stack: Stack) -> dict[str, str]:
    """Envoy's view of each ext_proc replica: address -> health flags."""
    text = urllib.request.urlopen(f"{stack.admin_url}/clusters", timeout=2).read().decode()  # noqa: S310
    flags = {}
    for line in text.splitlines():
        if line.startswith("modeldock_extproc::") and "::health_flags::" in line:
            _, address, _, value = line.split("::", 3)
            flags[address] = value
    return flags


def test_draining_replica_gets_no_new_streams_and_no_request_fails(stack: Stack, tmp_path: Path) -> None:
    addresses = [f"127.0.0.1:{p}" for p in stack.extproc_ports]
    wait_until(lambda: all(extproc_hosts(stack).get(a) == "healthy" for a in addresses), 15,
               what="both ext_proc replicas healthy in Envoy")
    client = stack.openai()
    failures: list[str] = []
    done = 0
    stop = threading.Event()

    def traffic() -> None:
        nonlocal done
        while not stop.is_set():
            try:
                reply = client.chat.completions.create(model="demo-model", max_tokens=2,
                                                       messages=[{"role": "user", "content": "x"}])
                assert reply.choices[0].message.content
                done += 1
            except Exception as exc:  # noqa: BLE001 (every failure is the finding)
                failures.append(repr(exc))

    threads = [threading.Thread(target=traffic) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: done >= 20, 20, what="traffic flowing")
        draining = next(c for c in stack.sup.children if c.name == "extproc-1")
        draining.proc.send_signal(signal.SIGTERM)
        # Envoy sees NOT_SERVING within a health-check interval, before the replica stops listening.
        wait_until(lambda: "failed_active_hc" in extproc_hosts(stack).get(addresses[1], ""), 2.5,
                   what="Envoy marking the draining replica unhealthy")
        draining.proc.wait(15)
        before = done
        wait_until(lambda: done >= before + 20, 20, what="traffic after the replica left")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not failures, failures[:5]
    assert draining.proc.returncode == 0
    log = (stack.run_dir / "extproc-1.log").read_text()
    assert "NOT_SERVING" in log
