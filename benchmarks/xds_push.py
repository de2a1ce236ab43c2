"""What building and pushing the endpoint snapshot costs, at 10, 1,000 and 10,000 endpoints over 100 models.

Part 1, in this process: time to build the ResourceSet from a Snapshot (a full
rebuild, a one-model change, and a rebuild with no change: what every tick and
confirmation costs), the time for a state-of-the-world and a delta stream to
produce (and serialize) their responses for a one-model change, and the sizes.

Part 2, the xDS server as its own process with 10,000 static endpoints and N
simulated ADS clients: its CPU time (from /proc/<pid>/stat) to sync the
clients and per one-model change, and its RSS (from /proc/<pid>/status).
A change is triggered with SIGUSR1 in a small server wrapper (`--serve`), so
the figures are the push alone, not a config-file re-read.

    .venv/bin/python -m benchmarks.xds_push            # writes the xds-push section of docs/benchmarks.md
    .venv/bin/python -m benchmarks.xds_push --no-write # print only
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from benchmarks._proc import cpu_seconds, rss_mb
from benchmarks._report import table, write_section
from modeldock.clock import FakeClock
from modeldock.config import ModelConfig, load_config
from modeldock.discovery.snapshot import Snapshot, SnapshotStore
from modeldock.types import Endpoint, cluster_name
from modeldock.xds.builder import ResourceBuilder
from modeldock.xds.cache import ResourceCache, ResourceSet
from modeldock.xds.delta import DeltaStream
from modeldock.xds.protocol import SotwStream
from modeldock.xds.resources import CLUSTER_TYPE, ENDPOINT_TYPE

MODELS = 100
SIZES = (10, 1_000, 10_000)
COMMAND = ".venv/bin/python -m benchmarks.xds_push"


# ---- part 1: in-process build and stream costs --------------------------------------------------


def model_configs(protocol_of_first: str = "http1") -> list[ModelConfig]:
    return [ModelConfig(name=f"m{i:03d}", endpoints=[], protocol=protocol_of_first if i == 0 else "http1")
            for i in range(MODELS)]


def endpoint_lists(total: int) -> dict[str, list[Endpoint]]:
    """Endpoint j belongs to model j % 100: at 10 endpoints, ten models have one each."""
    out: dict[str, list[Endpoint]] = {f"m{i:03d}": [] for i in range(MODELS)}
    for j in range(total):
        out[f"m{j % MODELS:03d}"].append(Endpoint(f"10.{j // 65536 % 256}.{j // 256 % 256}.{j % 256}", 8000))
    return out


def snapshots(total: int) -> tuple[Snapshot, Snapshot, FakeClock]:
    """Two snapshots that differ in one endpoint of model m000."""
    clock = FakeClock()
    store = SnapshotStore(clock)
    lists = endpoint_lists(total)
    for name, endpoints in lists.items():
        store.update(name, endpoints)
    first = store.current
    changed = list(lists["m000"])
    changed[0] = Endpoint(changed[0].host, 9000)
    store.update("m000", changed)
    return first, store.current, clock


def median_time(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sotw_requests(names: list[str]) -> list[discovery_pb2.DiscoveryRequest]:
    return [discovery_pb2.DiscoveryRequest(type_url=CLUSTER_TYPE),
            discovery_pb2.DiscoveryRequest(type_url=ENDPOINT_TYPE, resource_names=names)]


def delta_requests(names: list[str]) -> list[discovery_pb2.DeltaDiscoveryRequest]:
    return [discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER_TYPE),
            discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT_TYPE, resource_names_subscribe=names)]


def sotw_ack(resp: discovery_pb2.DiscoveryResponse, names: list[str]) -> discovery_pb2.DiscoveryRequest:
    subscribed = names if resp.type_url == ENDPOINT_TYPE else []
    return discovery_pb2.DiscoveryRequest(type_url=resp.type_url, version_info=resp.version_info,
                                          response_nonce=resp.nonce, resource_names=subscribed)


def delta_ack(resp: discovery_pb2.DeltaDiscoveryResponse, _names: list[str]) -> discovery_pb2.DeltaDiscoveryRequest:
    return discovery_pb2.DeltaDiscoveryRequest(type_url=resp.type_url, response_nonce=resp.nonce)


@dataclass
class StreamCost:
    initial_bytes: int  # the first EDS response: every assignment
    change_bytes: int  # one EDS response for a one-model change
    # on_change + serialization, as gRPC would send it. The first stream after a
    # change also computes the selection every later stream shares.
    first_seconds: float
    further_seconds: float


STREAMS = 50


def stream_cost(kind: str, sets: tuple[ResourceSet, ResourceSet], reps: int) -> StreamCost:
    names = [cluster_name(f"m{i:03d}") for i in range(MODELS)]
    make, requests, ack = ((SotwStream, sotw_requests, sotw_ack) if kind == "sotw"
                           else (DeltaStream, delta_requests, delta_ack))
    cache = ResourceCache()
    cache.set(sets[0])

    def subscribe() -> tuple[object, bytes]:
        stream = make(cache)
        eds = b""
        for request in requests(names):
            for resp in stream.on_request(request):
                data = resp.SerializeToString()
                if resp.type_url == ENDPOINT_TYPE:
                    eds = data
                stream.on_request(ack(resp, names))
        return stream, eds

    streams, initial = zip(*(subscribe() for _ in range(STREAMS)), strict=True)
    firsts, furthers, sizes = [], [], []
    for i in range(reps):
        cache.set(ResourceSet.build(sets[(i + 1) % 2].by_type))  # a new set: nothing memoized yet
        responses = []
        start = time.perf_counter()
        for n, stream in enumerate(streams):
            out = stream.on_change()  # type: ignore[attr-defined]
            payloads = [r.SerializeToString() for r in out]
            responses.append(out)
            if n == 0:
                firsts.append(time.perf_counter() - start)
                sizes.append(sum(map(len, payloads)))
                start = time.perf_counter()
        furthers.append((time.perf_counter() - start) / (STREAMS - 1))
        for stream, out in zip(streams, responses, strict=True):
            for resp in out:
                stream.on_request(ack(resp, names))  # type: ignore[attr-defined]
    return StreamCost(len(initial[0]), int(statistics.median(sizes)), statistics.median(firsts),
                      statistics.median(furthers))


@dataclass
class SizeResult:
    total: int
    full_build: float
    one_model_build: float
    idle_build: float
    sotw: StreamCost
    delta: StreamCost


def measure_size(total: int) -> SizeResult:
    first, second, clock = snapshots(total)
    now = clock.monotonic()
    models = model_configs()
    reps = 30 if total >= 10_000 else 100
    full = median_time(lambda: ResourceBuilder(models, 15).build(first, now), max(5, reps // 5))
    builder = ResourceBuilder(models, 15)
    builder.build(first, now)
    toggle = itertools.cycle((second, first))
    one = median_time(lambda: builder.build(next(toggle), now), reps)
    builder.build(first, now)
    idle = median_time(lambda: builder.build(first, now), reps)
    sets = (builder.build(first, now), builder.build(second, now))
    return SizeResult(total, full, one, idle, stream_cost("sotw", sets, reps), stream_cost("delta", sets, reps))


def cds_change_bytes() -> tuple[int, int]:
    """Bytes a one-cluster change (model m000 switched to HTTP/2) costs each client: SotW, delta."""
    first, _, clock = snapshots(10)
    sets = tuple(ResourceBuilder(model_configs(p), 15).build(first, clock.monotonic()) for p in ("http1", "http2"))
    out = []
    for make, requests, ack in ((SotwStream, sotw_requests, sotw_ack), (DeltaStream, delta_requests, delta_ack)):
        cache = ResourceCache()
        cache.set(sets[0])
        stream = make(cache)
        names = [cluster_name(f"m{i:03d}") for i in range(MODELS)]
        for request in requests(names):
            for resp in stream.on_request(request):
                stream.on_request(ack(resp, names))
        cache.set(sets[1])
        out.append(sum(r.ByteSize() for r in stream.on_change()))
    return out[0], out[1]


# ---- part 2: the server process and N ADS clients -----------------------------------------------


def write_config(path: Path, total: int) -> None:
    lists = endpoint_lists(total)
    models = [{"name": name, "endpoints": [e.address for e in eps]} for name, eps in lists.items()]
    path.write_text(yaml.safe_dump({"models": models}, sort_keys=False))


async def serve_child(config_path: str, port: int) -> None:
    """The xDS server plus a SIGUSR1 hook that changes one endpoint of one model."""
    from modeldock.xds.app import XdsOptions, XdsServer

    config = load_config(config_path)
    server = XdsServer(config, XdsOptions(Path(config_path), port=port))
    await server.start()
    counter = itertools.count(1)

    def change() -> None:
        k = next(counter)
        model = config.models[k % len(config.models)].name
        endpoints = list(server.store.current.endpoints(model))
        endpoints[0] = Endpoint(endpoints[0].host, 20_000 + k % 20_000)
        server.store.update(model, endpoints)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, change)
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await server.stop(0)


@dataclass
class AdsClient:
    """Behaves like Envoy on the wire: wildcard CDS, then EDS for every cluster, ACKing each response."""

    target: str
    names: list[str]
    delta: bool
    eds_responses: int = 0
    eds_bytes: list[int] = field(default_factory=list)
    synced: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        queue: asyncio.Queue[object] = asyncio.Queue()

        async def outgoing() -> AsyncIterator[object]:
            while (item := await queue.get()) is not None:
                yield item

        node = base_pb2.Node(id=f"bench-{id(self)}", cluster="bench")
        if self.delta:
            queue.put_nowait(discovery_pb2.DeltaDiscoveryRequest(node=node, type_url=CLUSTER_TYPE))
        else:
            queue.put_nowait(discovery_pb2.DiscoveryRequest(node=node, type_url=CLUSTER_TYPE))
        asked_eds = False
        async with grpc.aio.insecure_channel(self.target, options=[("grpc.max_receive_message_length", -1)]) as ch:
            stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(ch)
            call = (stub.DeltaAggregatedResources(outgoing()) if self.delta
                    else stub.StreamAggregatedResources(outgoing()))
            try:
                async for resp in call:
                    if self.delta:
                        queue.put_nowait(delta_ack(resp, self.names))
                    else:
                        queue.put_nowait(sotw_ack(resp, self.names if resp.type_url == ENDPOINT_TYPE else []))
                    if resp.type_url == CLUSTER_TYPE and not asked_eds:
                        asked_eds = True
                        queue.put_nowait(delta_requests(self.names)[1] if self.delta else sotw_requests(self.names)[1])
                    elif resp.type_url == ENDPOINT_TYPE:
                        self.eds_responses += 1
                        self.eds_bytes.append(resp.ByteSize())
                        self.synced.set()
                        self.progress.set()
            finally:
                queue.put_nowait(None)


@dataclass
class ServerResult:
    mode: str
    clients: int
    rss_idle: float
    idle_cpu_pct: float
    sync_cpu: float
    rss_synced: float
    change_cpu_ms: float
    change_wall_ms: float
    change_bytes: float


async def wait_all(clients: list[AdsClient], target: int, timeout: float = 30) -> None:
    async def one(c: AdsClient) -> None:
        while c.eds_responses < target:
            c.progress.clear()
            await c.progress.wait()

    await asyncio.wait_for(asyncio.gather(*(one(c) for c in clients)), timeout)


async def measure_server(config: Path, mode: str, n_clients: int, changes: int) -> ServerResult:
    from modeldock.up import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(config), str(port)],
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    tasks: list[asyncio.Task[None]] = []
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        assert line.strip() == b"ready", line
        await asyncio.sleep(1.0)  # let start-up settle (first static confirmation)
        pid = proc.pid
        rss_idle = rss_mb(pid)
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(3.0)
        idle_rate = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
        names = [cluster_name(f"m{i:03d}") for i in range(MODELS)]
        clients = [AdsClient(f"127.0.0.1:{port}", names, mode == "delta") for _ in range(n_clients)]
        cpu0 = cpu_seconds(pid)
        tasks = [asyncio.create_task(c.run()) for c in clients]
        await wait_all(clients, 1, 60)
        await asyncio.sleep(0.2)  # the ACKs
        sync_cpu = cpu_seconds(pid) - cpu0
        rss_synced = rss_mb(pid)
        walls = []
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        for k in range(changes):
            start = time.perf_counter()
            proc.send_signal(signal.SIGUSR1)
            await wait_all(clients, 2 + k)
            walls.append(time.perf_counter() - start)
            await asyncio.sleep(0.02)  # let the ACKs land before the next change
        elapsed = time.monotonic() - t0
        # Remove the background (ticks, confirmations) measured while idle.
        change_cpu = max(0.0, cpu_seconds(pid) - cpu0 - idle_rate * elapsed) / changes
        change_bytes = statistics.mean(b for c in clients for b in c.eds_bytes[1:])
        return ServerResult(mode, n_clients, rss_idle, idle_rate * 100, sync_cpu, rss_synced,
                            change_cpu * 1000, statistics.median(walls) * 1000, change_bytes)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- report -----------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def kb(n: float) -> str:
    return f"{n / 1024:.1f}"


def report(sizes: list[SizeResult], cds: tuple[int, int], servers: list[ServerResult], changes: int) -> str:
    build = table(
        ["endpoints", "full rebuild (new builder) ms", "one-model change ms", "one-model / full",
         "no-change rebuild ms"],
        [[f"{r.total:,}", ms(r.full_build), ms(r.one_model_build), f"{r.one_model_build / r.full_build:.3f}",
          ms(r.idle_build)] for r in sizes],
    )
    streams = table(
        ["endpoints", "full EDS state KB", "SotW first stream ms", "SotW each further stream ms",
         "delta first stream ms", "delta each further stream ms", "SotW change bytes", "delta change bytes",
         "delta / SotW bytes", "change / full state bytes"],
        [[f"{r.total:,}", kb(r.sotw.initial_bytes), ms(r.sotw.first_seconds), ms(r.sotw.further_seconds),
          ms(r.delta.first_seconds), ms(r.delta.further_seconds), r.sotw.change_bytes, r.delta.change_bytes,
          f"{r.delta.change_bytes / r.sotw.change_bytes:.2f}", f"{r.sotw.change_bytes / r.sotw.initial_bytes:.4f}"]
         for r in sizes],
    )
    server = table(
        ["protocol", "clients", "RSS idle MB", "RSS synced MB", "idle CPU %", "sync CPU s", "CPU per change ms",
         "CPU per change per client ms", "change wall p50 ms", "bytes per change per client"],
        [[s.mode, s.clients, f"{s.rss_idle:.0f}", f"{s.rss_synced:.0f}", f"{s.idle_cpu_pct:.1f}",
          f"{s.sync_cpu:.2f}", f"{s.change_cpu_ms:.1f}", f"{s.change_cpu_ms / s.clients:.2f}",
          f"{s.change_wall_ms:.1f}", f"{s.change_bytes:.0f}"] for s in servers],
    )
    full = sizes[-1]
    return f"""
100 models; endpoint j belongs to model j % 100 (at 10 endpoints, ten models have one each).
A one-model change replaces one endpoint of model m000. Times are medians.

### Building the ResourceSet from a Snapshot

{build}

The builder keeps each model's last assignment and rebuilds only models whose endpoint list changed:
at {full.total:,} endpoints a one-model change costs {full.one_model_build / full.full_build:.1%} of a full rebuild.
A full rebuild (a new builder: 100 clusters and 100 assignments) happens at start-up. The no-change
rebuild is what every staleness tick and every discovery confirmation costs.

### Stream responses for a one-model change (on_change + serialization)

{streams}

{STREAMS} streams subscribed like Envoy share one cache. After each change, the first stream also
computes the selection (the subscribed resources and their version), which the ResourceSet memoizes
for every later stream with the same subscription.

State-of-the-world EDS already sends only the assignments that changed for the client (EDS is not a
wildcard type), so delta saves nothing on endpoint changes: its per-resource wrapper costs a few bytes
more. Delta wins on CDS, where SotW must resend every cluster: a one-cluster change (model m000
switched to HTTP/2) costs each client {cds[0]:,} bytes in SotW and {cds[1]:,} in delta ({cds[1] / cds[0]:.3f}x).

### The xDS server process at 10,000 endpoints with N ADS clients

{server}

Each client subscribes like Envoy (wildcard CDS, then EDS for all {MODELS} clusters) and ACKs every
response. RSS idle is before any client connects. Idle CPU is the background (staleness tick every
0.5 s, static-file confirmation every 1 s) with no client. Sync CPU is the server's CPU from the first
connection until every client has its first EDS response. CPU per change is over {changes} one-model
changes, background subtracted (the clock-tick resolution is 10 ms, so small values are approximate);
change wall is from the signal to the last client receiving the push.
"""


async def run_servers(changes: int) -> list[ServerResult]:
    results = []
    with tempfile.TemporaryDirectory(prefix="xds-push-") as tmp:
        config = Path(tmp) / "config.yaml"
        write_config(config, 10_000)
        for mode in ("sotw", "delta"):
            for n in (1, 10, 50):
                result = await measure_server(config, mode, n, changes)
                print(result, flush=True)
                results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs/benchmarks.md")
    parser.add_argument("--changes", type=int, default=20, help="one-model changes per server run")
    parser.add_argument("--serve", nargs=2, metavar=("CONFIG", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve_child(args.serve[0], int(args.serve[1])))
        return
    sizes = []
    for total in SIZES:
        result = measure_size(total)
        print(result, flush=True)
        sizes.append(result)
    cds = cds_change_bytes()
    servers = asyncio.run(run_servers(args.changes))
    body = report(sizes, cds, servers, args.changes)
    print(body)
    if not args.no_write:
        write_section("xds-push", "xDS snapshot build and push cost", COMMAND, body)


if __name__ == "__main__":
    main()
