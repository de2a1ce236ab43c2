"""Kubernetes discovery end to end: EndpointSlices on a fake API server -> `modeldock xds` -> real Envoy.

The xDS server process reads a kubeconfig that points at a `FakeKubeServer` in this process.
Each simulator listens on its own port, so each gets its own EndpointSlice: the same port
*name* (`http`, which the config names) with that simulator's port number, as a Service with
several slices would have it. Routing is round robin so that every listed endpoint gets a
share of a handful of sequential requests.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from modeldock.types import cluster_name
from tests.support.fake_kube import FakeKubeServer, make_slice
from tests.support.stack import Sim, Stack, http_json, running_stack, wait_until

pytestmark = pytest.mark.e2e

NAMESPACE, SERVICE, PORT_NAME = "llm", "vllm", "http"
MODEL = "demo-model"
CLUSTER = cluster_name(MODEL)
MSG = [{"role": "user", "content": "hello"}]
STALE_AFTER = 3.0  # discovery.stale_after_seconds: short, so staleness shows within seconds
# Real time with 20 ms steps: a one-token request takes a few tens of ms, a long stream is visible.
SIM_ARGS = ("--step-base-ms", "20", "--speed", "1")
START_ATTEMPTS = 3
PORT_TAKEN = ("Address already in use", "Failed to bind")  # a child's port was taken before it bound


@pytest.fixture
def kube() -> Iterator[FakeKubeServer]:
    server = FakeKubeServer()
    try:
        yield server
    finally:
        server.close()


def slice_name(sim: Sim) -> str:
    return f"{SERVICE}-{sim.port}"


def sim_slice(sim: Sim, *, ready: bool | None = True, terminating: bool | None = False) -> dict[str, Any]:
    """The EndpointSlice of one simulator: its own port number under the shared port name."""
    return make_slice(slice_name(sim), NAMESPACE, SERVICE, [("127.0.0.1", ready, terminating)], PORT_NAME, sim.port)


@contextmanager
def kube_stack(run_dir: Path, kube: FakeKubeServer, *, backends: int = 3, listed: int | None = None,
               stale_after: float = STALE_AFTER) -> Iterator[Stack]:
    """The real stack with `demo-model` discovered from Service llm/vllm; the first `listed` sims have slices."""
    applied: list[str] = []

    def edit(data: dict[str, Any], sims: list[Sim]) -> None:
        data["models"] = [{"name": MODEL, "kubernetes": {"namespace": NAMESPACE, "service": SERVICE,
                                                         "port": PORT_NAME}}]
        data["routing"] = {"policy": "round_robin"}
        data["discovery"] = {"stale_after_seconds": stale_after}
        for sim in sims[:listed]:
            kube.apply(sim_slice(sim))
            applied.append(slice_name(sim))

    kubeconfig = kube.write_kubeconfig(run_dir / "kubeconfig")
    for attempt in range(1, START_ATTEMPTS + 1):
        exits = ExitStack()
        try:
            stack = exits.enter_context(running_stack(
                run_dir / f"stack{attempt}", backends=backends, sim_args=SIM_ARGS, edit_config=edit,
                xds_args=("--kubeconfig", str(kubeconfig))))
        except AssertionError as exc:
            exits.close()
            if attempt == START_ATTEMPTS or not any(sign in str(exc) for sign in PORT_TAKEN):
                raise
            # free_port() releases an ephemeral port before the child binds it, and on a busy machine
            # an outgoing connection can take it meanwhile: start again on fresh ports and slices.
            for name in applied:
                kube.delete(NAMESPACE, name)
            applied.clear()
            continue
        with exits:
            # One request through the whole chain before the test's own counting starts.
            wait_until(functools.partial(serves, stack), 20, what="the gateway to serve a request")
            yield stack
        return


# ---- what Envoy and the simulators saw ------------------------------------------------


def envoy_hosts(stack: Stack) -> set[str]:
    """The hosts of the model's cluster in Envoy's admin `/clusters`."""
    data = http_json("GET", f"{stack.admin_url}/clusters?format=json")
    for cluster in data.get("cluster_statuses", []):
        if cluster["name"] == CLUSTER:
            return {_address(host["address"]) for host in cluster.get("host_statuses", [])}
    return set()


def eds_endpoints(stack: Stack) -> set[str]:
    """The endpoints of the ClusterLoadAssignment Envoy holds, from `/config_dump?include_eds`."""
    dump = http_json("GET", f"{stack.admin_url}/config_dump?include_eds")
    for config in dump["configs"]:
        if not config["@type"].endswith("EndpointsConfigDump"):
            continue
        for entry in config.get("dynamic_endpoint_configs", []):
            assignment = entry["endpoint_config"]
            if assignment["cluster_name"] == CLUSTER:
                return {_address(lb["endpoint"]["address"])
                        for locality in assignment.get("endpoints", []) for lb in locality.get("lb_endpoints", [])}
    raise AssertionError(f"no ClusterLoadAssignment for {CLUSTER} in Envoy's config dump")


def _address(address: dict[str, Any]) -> str:
    socket = address["socket_address"]
    return f"{socket['address']}:{socket['port_value']}"


def addresses(*sims: Sim) -> set[str]:
    return {sim.address for sim in sims}


def wait_for_hosts(stack: Stack, *sims: Sim, timeout: float = 15.0) -> None:
    want = addresses(*sims)
    wait_until(lambda: envoy_hosts(stack) == want, timeout, what=f"Envoy's hosts to become {sorted(want)}")


def received(stack: Stack) -> dict[int, int]:
    """Completion requests each simulator has received so far, by port."""
    return {sim.port: sim.stats()["received"] for sim in stack.sims}


def chat(stack: Stack, max_tokens: int = 1) -> None:
    reply = stack.openai(timeout=10).chat.completions.create(model=MODEL, messages=MSG, max_tokens=max_tokens)
    assert reply.choices[0].message.content


def spread(stack: Stack, requests: int) -> dict[int, int]:
    """Send sequential requests (all must succeed); how many each simulator received."""
    before = received(stack)
    for _ in range(requests):
        chat(stack)
    after = received(stack)
    return {port: after[port] - before[port] for port in after}


def serves(stack: Stack) -> bool:
    try:
        chat(stack)
    except openai.APIError:
        return False
    return True


def stale_error(stack: Stack) -> openai.APIStatusError | None:
    """The 503 a request gets when the model's snapshot is stale; None if it got something else."""
    try:
        chat(stack)
    except openai.APIStatusError as exc:
        if exc.status_code == 503 and isinstance(exc.body, dict) and exc.body.get("code") == "endpoint_snapshot_stale":
            return exc
    return None


def xds_metric(stack: Stack, name: str) -> float:
    return stack.metric(name, stack.xds_metrics_port)


def xds_clients(stack: Stack) -> float:
    """ADS streams open on the xDS server; -1 while its metrics port is not up (restarting)."""
    try:
        return xds_metric(stack, "modeldock_xds_connected_clients")
    except OSError:
        return -1


# ---- tests -----------------------------------------------------------------------------


def test_not_ready_and_terminating_endpoints_get_no_new_requests(tmp_path: Path, kube: FakeKubeServer) -> None:
    with kube_stack(tmp_path, kube, backends=3) as stack:
        a, b, c = stack.sims
        wait_for_hosts(stack, a, b, c)
        assert all(count > 0 for count in spread(stack, 6).values()), "round robin reaches every listed endpoint"

        # A long stream is running on c when c starts terminating: the stream is not cut.
        stream = stack.openai(timeout=30).chat.completions.create(model=MODEL, messages=MSG, max_tokens=60,
                                                                   stream=True)
        chunks = iter(stream)
        first = next(chunks)
        running = [sim for sim in stack.sims if sim.stats()["running"] == 1]
        assert len(running) == 1, "the stream runs on one endpoint"
        streaming = running[0]
        rest = [sim for sim in stack.sims if sim is not streaming]

        kube.apply(sim_slice(streaming, ready=True, terminating=True))  # e.g. publishNotReadyAddresses
        kube.apply(sim_slice(rest[0], ready=False, terminating=False))
        wait_for_hosts(stack, rest[1])
        assert eds_endpoints(stack) == addresses(rest[1]), "removed from the assignment, not just marked unhealthy"

        # New requests go only to the endpoint still ready; the old stream runs to its end.
        counts = spread(stack, 6)
        assert counts == {streaming.port: 0, rest[0].port: 0, rest[1].port: 6}
        received_chunks = [chunk for chunk in [first, *chunks] if chunk.choices]
        assert "".join(chunk.choices[0].delta.content or "" for chunk in received_chunks)
        assert received_chunks[-1].choices[0].finish_reason == "length", "the stream ran to its end"
        wait_until(lambda: streaming.stats()["completed"] >= 1, 5, what="the stream to complete on its endpoint")
        assert streaming.stats()["cancelled"] == 0

        # Ready again (ready unset counts as ready): back in rotation.
        kube.apply(sim_slice(rest[0], ready=None, terminating=None))
        wait_for_hosts(stack, rest[0], rest[1])
        counts = spread(stack, 6)
        assert counts[streaming.port] == 0 and counts[rest[0].port] > 0 and counts[rest[1].port] > 0


def test_added_endpoint_gets_requests_and_deleted_slice_gets_none(tmp_path: Path, kube: FakeKubeServer) -> None:
    with kube_stack(tmp_path, kube, backends=3, listed=2) as stack:
        a, b, new = stack.sims
        wait_for_hosts(stack, a, b)
        assert spread(stack, 4)[new.port] == 0, "an endpoint without a slice gets nothing"

        kube.apply(sim_slice(new))
        wait_for_hosts(stack, a, b, new)
        # ext_proc learns the endpoint over its own ADS stream, at about the same time as Envoy.
        deadline = time.monotonic() + 10
        while spread(stack, 3)[new.port] == 0:
            assert time.monotonic() < deadline, "the new endpoint never got a request"

        kube.delete(NAMESPACE, slice_name(a))
        wait_for_hosts(stack, b, new)
        assert eds_endpoints(stack) == addresses(b, new)
        counts = spread(stack, 6)
        assert counts[a.port] == 0 and counts[b.port] > 0 and counts[new.port] > 0


@pytest.mark.parametrize("outage", ["paused", "stopped"])
def test_api_server_gone_past_cutoff_is_503_stale_then_recovers(tmp_path: Path, kube: FakeKubeServer,
                                                                outage: str) -> None:
    with kube_stack(tmp_path, kube, backends=2) as stack:
        a, b = stack.sims
        wait_for_hosts(stack, a, b)
        if outage == "paused":  # once is enough: it takes longer than the cutoff
            # A quiet, healthy Service stays fresh: watches end on time (a third of the cutoff) and confirm.
            quiet_until = time.monotonic() + STALE_AFTER * 1.5
            while time.monotonic() < quiet_until:
                chat(stack)
                time.sleep(0.1)
            assert xds_metric(stack, "modeldock_xds_stale") == 0

        gone = time.monotonic()
        if outage == "paused":
            kube.pause()  # requests hang and the open watch delivers nothing
        else:
            kube.stop()  # connections refused
        chat(stack)  # the last confirmed snapshot is still served within the cutoff

        deadline = gone + STALE_AFTER + 10
        error = None
        while error is None:
            assert time.monotonic() < deadline, "requests never got 503 endpoint_snapshot_stale"
            error = stale_error(stack)
            if error is None:
                time.sleep(0.1)
        went_stale = time.monotonic() - gone
        # The last confirmation came at most about one watch timeout (1 s) before the outage began.
        assert went_stale > STALE_AFTER - 2, f"stale after {went_stale:.1f}s, well before the cutoff"
        assert isinstance(error, openai.InternalServerError) and error.status_code == 503
        assert "stale" in error.body["message"] and MODEL in error.body["message"]
        assert error.body["type"] and error.body["code"] == "endpoint_snapshot_stale"
        for _ in range(3):
            assert stale_error(stack) is not None, "every request is refused while stale"
        # Envoy got an empty assignment: it would not dispatch either.
        wait_for_hosts(stack)
        assert eds_endpoints(stack) == set()
        assert xds_metric(stack, "modeldock_xds_stale") == 1

        if outage == "paused":
            kube.resume()
        else:
            kube.start()
        wait_for_hosts(stack, a, b, timeout=20)
        wait_until(lambda: stale_error(stack) is None, 10, what="requests to succeed again")
        assert sum(spread(stack, 4).values()) == 4
        assert xds_metric(stack, "modeldock_xds_stale") == 0


class Load:
    """Sequential requests on a background thread until stopped; every outcome is kept."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.outcomes: list[tuple[float, str]] = []  # (monotonic time, "ok" or the error)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        wait_until(lambda: self.successes_since(0) >= 5, 10, what="traffic to flow")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                chat(self.stack)
                self.outcomes.append((time.monotonic(), "ok"))
            except Exception as exc:  # noqa: BLE001 (recorded and asserted on by the test)
                self.outcomes.append((time.monotonic(), repr(exc)))

    def successes_since(self, moment: float) -> int:
        return sum(1 for at, result in list(self.outcomes) if at > moment and result == "ok")

    def keep_flowing(self, what: str, count: int = 5) -> None:
        now = time.monotonic()
        wait_until(lambda: self.successes_since(now) >= count, 10, what=f"traffic {what}")

    def failures(self, since: float) -> list[tuple[float, str]]:
        return [(round(at - since, 2), result) for at, result in self.outcomes if result != "ok"]


def stop_xds(stack: Stack) -> list[str]:
    """SIGTERM the xDS server and wait for it to exit; returns its command line, to start it again."""
    xds = next(child for child in stack.sup.children if child.name == "xds" and child.proc.poll() is None)
    command = [str(arg) for arg in xds.proc.args]  # type: ignore[union-attr]
    xds.proc.send_signal(signal.SIGTERM)
    assert xds.proc.wait(15) == 0
    return command


def test_xds_restart_does_not_interrupt_traffic(tmp_path: Path, kube: FakeKubeServer) -> None:
    # The restart (a 2 s stop grace, a new Python process, ext_proc's reconnect backoff: about 5 s
    # here, more on a loaded machine) must stay within the cutoff, since ext_proc stops dispatching
    # once it has been cut off from xDS for that long: use the default, 15 s.
    with kube_stack(tmp_path, kube, backends=2, stale_after=15.0) as stack:
        a, b = stack.sims
        wait_for_hosts(stack, a, b)
        with Load(stack) as load:
            down = time.monotonic()
            command = stop_xds(stack)
            wait_until(lambda: stack.envoy_stat("control_plane.connected_state") == 0, 10,
                       what="Envoy to notice the xDS server is gone")
            load.keep_flowing("while the xDS server is down")
            stack.sup.start("xds", command)
            wait_until(lambda: stack.envoy_stat("control_plane.connected_state") == 1, 20,
                       what="Envoy to reconnect to the new xDS server")
            wait_until(lambda: xds_clients(stack) == 2, 20,
                       what="Envoy and ext_proc to subscribe to the new xDS server")
            load.keep_flowing("after the restart")
        assert not load.failures(down), f"requests failed (seconds after SIGTERM): {load.failures(down)}"
        assert envoy_hosts(stack) == addresses(a, b)

        # The new process is the one serving: a change in the slices reaches Envoy and ext_proc.
        kube.apply(sim_slice(a, ready=False))
        wait_for_hosts(stack, b)
        assert spread(stack, 4) == {a.port: 0, b.port: 4}


def test_xds_restart_waits_for_its_first_list(tmp_path: Path, kube: FakeKubeServer) -> None:
    # A new xDS server knows nothing until discovery has listed; answering before that would
    # replace the endpoints Envoy and ext_proc hold with nothing. It waits (bounded) instead.
    with kube_stack(tmp_path, kube, backends=2, stale_after=15.0) as stack:
        a, b = stack.sims
        wait_for_hosts(stack, a, b)
        with Load(stack) as load:
            down = time.monotonic()
            kube.pause()  # the API server is slow to answer the new process's list...
            try:
                command = stop_xds(stack)
                stack.sup.start("xds", command)
                time.sleep(2)  # ...for a while, but less than the xDS server's first-list wait
                assert xds_clients(stack) <= 0, "the new xDS server answered before it had listed"
                load.keep_flowing("while the new xDS server waits for its list")
            finally:
                kube.resume()
            wait_until(lambda: xds_clients(stack) == 2, 20,
                       what="Envoy and ext_proc to subscribe to the new xDS server")
            load.keep_flowing("after the restart")
        assert not load.failures(down), f"requests failed (seconds after SIGTERM): {load.failures(down)}"
        assert envoy_hosts(stack) == addresses(a, b)


def test_expired_resource_version_relists_and_converges(tmp_path: Path, kube: FakeKubeServer) -> None:
    with kube_stack(tmp_path, kube, backends=3, listed=2) as stack:
        a, b, c = stack.sims
        wait_for_hosts(stack, a, b)
        wait_until(lambda: any(r.is_watch for r in kube.requests), 10, what="a watch")
        seen = len(kube.requests)

        # Changes the open watch never delivers, then the history is compacted away: the
        # watch resumes from a resourceVersion that is gone (410), and only a re-list finds them.
        kube.pause()
        kube.apply(sim_slice(a, ready=False))
        kube.apply(sim_slice(c))
        kube.compact()
        kube.resume()

        wait_for_hosts(stack, b, c)
        assert eds_endpoints(stack) == addresses(b, c)
        after = kube.requests[seen:]
        expired = next(i for i, r in enumerate(after) if r.is_watch and "ERROR" in r.sent)
        relist = [r for r in after[expired + 1:] if not r.is_watch and r.status == 200]
        assert relist, "the 410 was followed by a fresh list"
        assert "resourceVersion" not in relist[0].params, "a full list, not a resume"
        wait_until(lambda: spread(stack, 2)[c.port] > 0, 10, what="the re-listed endpoint to get requests")
        counts = spread(stack, 4)
        assert counts[a.port] == 0 and counts[b.port] > 0 and counts[c.port] > 0
        assert xds_metric(stack, "modeldock_xds_stale") == 0


def test_xds_restart_while_api_server_is_down_keeps_last_endpoints(tmp_path: Path, kube: FakeKubeServer) -> None:
    # Until the cutoff, the endpoints Envoy and ext_proc hold stay in use: the new server, which has
    # never listed, sends no assignment for the model. The cutoff counts from the new server's start;
    # after it, an empty assignment and 503 endpoint_snapshot_stale, as for a running server.
    # The new server listens at once and holds streams until its first-list wait ends, so Envoy
    # reconnects within its first few (short) backoffs and is answered then, well before the cutoff.
    with kube_stack(tmp_path, kube, backends=2, stale_after=15.0) as stack:
        a, b = stack.sims
        wait_for_hosts(stack, a, b)
        kube.pause()  # the API server stays unreachable for longer than the first-list wait and the cutoff
        try:
            command = stop_xds(stack)
            restarted = time.monotonic()  # the new server starts after this: its cutoff comes later
            stack.sup.start("xds", command)
            wait_until(lambda: xds_clients(stack) == 2, 20, what="Envoy and ext_proc to resubscribe")
            time.sleep(0.5)  # let whatever the new server pushed arrive
            hosts = envoy_hosts(stack)
            assert hosts == addresses(a, b), f"{time.monotonic() - restarted:.1f}s after the restart"
            assert sum(spread(stack, 4).values()) == 4

            error = None
            while error is None:
                assert time.monotonic() < restarted + 15.0 + 10, "requests never got 503 endpoint_snapshot_stale"
                error = stale_error(stack)
                if error is None:
                    time.sleep(0.1)
            went_stale = time.monotonic() - restarted
            assert went_stale >= 15.0, f"stale {went_stale:.1f}s after the restart, before the cutoff"
            wait_for_hosts(stack)
            assert eds_endpoints(stack) == set()
        finally:
            kube.resume()
        wait_for_hosts(stack, a, b, timeout=20)
        wait_until(lambda: stale_error(stack) is None, 10, what="requests to succeed again")
        assert sum(spread(stack, 4).values()) == 4
