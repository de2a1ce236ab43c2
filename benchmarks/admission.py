"""What admission costs per request, without Redis and with a real Redis, side by side.

Three measurements in one run:
  decision    Admission.admit + Ticket.release, in process (µs per request, sequential)
  flow        RequestFlow request headers + body + response headers + finish, in process (µs per request)
  throughput  the real grpc.aio ExtProcServicer in a subprocess, driven by 64 concurrent ext_proc streams
              (request headers, buffered body, response headers, as Envoy sends them): streams/s

Each is run for a tenant with no rate limit (in-flight slot only), with the local sliding windows only
(tenant and per-model limit, no Redis), and with the local windows plus the shared Redis window (a
redis-server started for the run on loopback). Variants alternate round by round so machine noise
hits them alike; the ratio to the local-only variant is the result.

    .venv/bin/python -m benchmarks.admission [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from benchmarks._extproc import envoy_messages
from benchmarks._proc import cpu_seconds
from benchmarks._report import table, write_section
from modeldock.admission.limits import Admission
from modeldock.bench.stats import nearest_rank
from modeldock.clock import SystemClock
from modeldock.config import Config, hash_key, parse_config
from modeldock.devstack.redis_server import RedisServer
from modeldock.extproc.app import build_picker
from modeldock.extproc.flow import RequestFlow
from modeldock.extproc.wire import add_servicer
from modeldock.gateway import Gateway
from modeldock.types import Endpoint

COMMAND = ".venv/bin/python -m benchmarks.admission"
MODEL = "m"
BIG = 10**9  # a limit never reached, so every request pays for the check and is admitted
KEYS = {"free": "bench-free-key", "limited": "bench-limited-key"}
VARIANTS = ("no rate limit", "local windows", "local + Redis")


def config(redis_url: str | None) -> Config:
    return parse_config({
        "tenants": [
            {"id": "free", "api_key_hashes": [hash_key(KEYS["free"])], "models": ["*"]},
            {"id": "limited", "api_key_hashes": [hash_key(KEYS["limited"])], "models": ["*"],
             "requests_per_minute": BIG, "requests_per_minute_per_model": {MODEL: BIG}},
        ],
        "models": [{"name": MODEL, "endpoints": ["127.0.0.1:1", "127.0.0.1:2"]}],
        "limits": {"redis_url": redis_url, "redis_timeout_ms": 1000},
    })


def variant_setup(variant: str, redis_url: str) -> tuple[Config, str]:
    """(config, tenant id) for a variant."""
    if variant == "no rate limit":
        return config(None), "free"
    if variant == "local windows":
        return config(None), "limited"
    return config(redis_url), "limited"


def gateway(cfg: Config) -> Gateway:
    clock = SystemClock()
    gw = Gateway(cfg, clock, build_picker(cfg.routing, clock, None), Admission(cfg, clock))
    gw.on_endpoints(MODEL, (Endpoint("127.0.0.1", 1), Endpoint("127.0.0.1", 2)))
    return gw


def messages(key: str) -> list[ep.ProcessingRequest]:
    return envoy_messages(key, MODEL)


# ---------------------------------------------------------------- in process: decision and flow


async def timed(step: Callable[[], Awaitable[None]], seconds: float) -> tuple[list[int], float]:
    """Wall ns per call of `step`, and this process's CPU seconds over the run."""
    samples: list[int] = []
    clock = time.perf_counter_ns
    cpu = time.process_time()
    end = clock() + int(seconds * 1e9)
    while clock() < end:
        t0 = clock()
        await step()
        samples.append(clock() - t0)
    return samples, time.process_time() - cpu


async def time_decisions(admission: Admission, tenant: Any, seconds: float) -> tuple[list[int], float]:
    """Per admit+release."""
    async def step() -> None:
        ticket = await admission.admit(tenant, MODEL)
        ticket.release()

    return await timed(step, seconds)


async def time_flows(gw: Gateway, msgs: list[ep.ProcessingRequest], seconds: float) -> tuple[list[int], float]:
    """Per RequestFlow over Envoy's messages, finished."""
    async def step() -> None:
        flow = RequestFlow(gw)
        for m in msgs:
            resp = await flow.handle(m)
        flow.finish()
        assert resp.WhichOneof("response") == "request_body", resp

    return await timed(step, seconds)


def in_process(redis_url: str, rounds: int, seconds: float) -> tuple[dict[str, dict[str, list[int]]],
                                                                     dict[str, dict[str, float]]]:
    """Per kind ("decision", "flow") and variant: wall ns samples, and CPU µs per request."""
    cpu: dict[str, dict[str, float]] = {"decision": {}, "flow": {}}

    async def run() -> dict[str, dict[str, list[int]]]:
        out: dict[str, dict[str, list[int]]] = {"decision": {}, "flow": {}}
        setups = {}
        for v in VARIANTS:
            cfg, tid = variant_setup(v, redis_url)
            gw = gateway(cfg)
            tenant = next(t for t in cfg.tenants if t.id == tid)
            setups[v] = (gw, tenant, messages(KEYS[tid]))
            # Warm up: connect to Redis, load the script, fill caches.
            await time_decisions(gw.admission, tenant, 0.2)
            await time_flows(gw, setups[v][2], 0.2)
        for _ in range(rounds):
            for v in VARIANTS:
                gw, tenant, msgs = setups[v]
                for kind, (samples, used) in (("decision", await time_decisions(gw.admission, tenant, seconds)),
                                              ("flow", await time_flows(gw, msgs, seconds))):
                    out[kind].setdefault(v, []).extend(samples)
                    cpu[kind][v] = cpu[kind].get(v, 0.0) + used
        for gw, _, _ in setups.values():
            assert gw.picker.total_in_flight() == 0
            await gw.admission.close()
        return out

    wall = asyncio.run(run())
    return wall, {k: {v: cpu[k][v] / len(wall[k][v]) * 1e6 for v in VARIANTS} for k in cpu}


# ---------------------------------------------------------------- throughput: the servicer in a subprocess


async def serve(variant: str, redis_url: str) -> None:
    from modeldock.extproc.server import ExtProcServicer

    cfg, _ = variant_setup(variant, redis_url)
    gw = gateway(cfg)
    server = grpc.aio.server()
    add_servicer(ExtProcServicer(gw), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def drive(port: int, key: str, seconds: float, concurrency: int,
                pids: tuple[int, int]) -> tuple[int, list[float], int, float, float, float]:
    """Streams completed, their latencies (s), streams answered with anything but a pass, and over the
    measured span: wall seconds, CPU seconds of pids[0] (ext_proc) and pids[1] (Redis)."""
    msgs = messages(key)
    expected = ["request_body"]
    lat: list[float] = []
    refused = 0
    loop = asyncio.get_running_loop()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)

        async def worker(stop_at: float) -> None:
            nonlocal refused
            while loop.time() < stop_at:
                t = time.perf_counter()
                call = stub.Process()
                for m, kind in zip(msgs, expected, strict=True):
                    await call.write(m)
                    resp = await call.read()
                    if resp.WhichOneof("response") != kind:
                        refused += 1
                        break
                await call.done_writing()
                await call.read()  # end of stream: the servicer released the request
                lat.append(time.perf_counter() - t)

        await asyncio.gather(*(worker(loop.time() + 0.5) for _ in range(concurrency)))  # warm up
        lat.clear()
        refused = 0
        cpu0, rcpu0, t0 = cpu_seconds(pids[0]), cpu_seconds(pids[1]), time.perf_counter()
        await asyncio.gather(*(worker(loop.time() + seconds) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        cpu, rcpu = cpu_seconds(pids[0]) - cpu0, cpu_seconds(pids[1]) - rcpu0
    return len(lat), lat, refused, wall, cpu, rcpu


def throughput(redis: RedisServer, rounds: int, seconds: float, concurrency: int) -> dict[str, dict[str, Any]]:
    procs = {v: subprocess.Popen([sys.executable, __file__, "--serve", v, "--redis-url", redis.url],
                                 stdout=subprocess.PIPE, text=True) for v in VARIANTS}
    results: dict[str, dict[str, Any]] = {v: {"streams": 0, "wall": 0.0, "cpu": 0.0, "redis_cpu": 0.0, "lat": [],
                                              "refused": 0} for v in VARIANTS}
    try:
        ports = {v: int(p.stdout.readline()) for v, p in procs.items()}  # type: ignore[union-attr]
        for _ in range(rounds):
            for v, p in procs.items():
                tid = variant_setup(v, redis.url)[1]
                assert redis.pid is not None
                n, lat, refused, wall, cpu, rcpu = asyncio.run(
                    drive(ports[v], KEYS[tid], seconds, concurrency, (p.pid, redis.pid)))
                r = results[v]
                r["wall"] += wall
                r["cpu"] += cpu
                r["redis_cpu"] += rcpu
                r["streams"] += n
                r["lat"].extend(lat)
                r["refused"] += refused
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    return results


# ---------------------------------------------------------------- report


def cpu_per_stream(r: dict[str, Any]) -> float:
    """ext_proc CPU µs per completed stream."""
    return r["cpu"] / max(r["streams"], 1) * 1e6


def us(ns: float) -> str:
    return f"{ns / 1000:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short runs, to check the script works")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.redis_url))
        return

    rounds, seconds, tp_seconds = (2, 0.2, 1.0) if args.quick else (5, 0.6, 4.0)
    with RedisServer() as redis:
        local, local_cpu = in_process(redis.url, rounds, seconds)
        tp = throughput(redis, 2 if args.quick else 3, tp_seconds, args.concurrency)
        server_version = subprocess.run([redis.binary, "--version"], capture_output=True, text=True).stdout.split()
    version = next((w for w in server_version if w.startswith("v=")), "v=?")[2:]
    server_name = Path(redis.binary).name

    rows = []
    base = {kind: nearest_rank(local[kind]["local windows"], 50) for kind in ("decision", "flow")}
    for v in VARIANTS:
        d, f = local["decision"][v], local["flow"][v]
        rows.append([v, us(nearest_rank(d, 50)), us(nearest_rank(d, 99)), f"{local_cpu['decision'][v]:.1f}",
                     f"{nearest_rank(d, 50) / base['decision']:.2f}",
                     us(nearest_rank(f, 50)), us(nearest_rank(f, 99)), f"{local_cpu['flow'][v]:.1f}",
                     f"{nearest_rank(f, 50) / base['flow']:.2f}"])
    tp_rows = []
    tp_base = tp["local windows"]["streams"] / tp["local windows"]["wall"]
    for v in VARIANTS:
        r = tp[v]
        rate = r["streams"] / r["wall"]
        tp_rows.append([v, f"{rate:,.0f}", f"{rate / tp_base:.2f}", f"{nearest_rank(r['lat'], 50) * 1000:.1f}",
                        f"{nearest_rank(r['lat'], 99) * 1000:.1f}", f"{r['cpu'] / r['wall'] * 100:.0f}%",
                        f"{cpu_per_stream(r):.0f}", f"{1e6 / cpu_per_stream(r):,.0f}",
                        f"{r['redis_cpu'] / r['wall'] * 100:.0f}%", r["refused"]])
    redis_decision = nearest_rank(local["decision"]["local + Redis"], 50) / base["decision"]
    # Means here, to compare with CPU time (also a mean): wall added per decision, and CPU added per decision.
    redis_decision_us = (statistics.fmean(local["decision"]["local + Redis"])
                         - statistics.fmean(local["decision"]["local windows"])) / 1000
    redis_decision_cpu_us = local_cpu["decision"]["local + Redis"] - local_cpu["decision"]["local windows"]
    redis_flow = nearest_rank(local["flow"]["local + Redis"], 50) / base["flow"]
    redis_tp = tp["local + Redis"]["streams"] / tp["local + Redis"]["wall"] / tp_base
    redis_cpu = cpu_per_stream(tp["local + Redis"]) / cpu_per_stream(tp["local windows"])
    redis_cpu_us = cpu_per_stream(tp["local + Redis"]) - cpu_per_stream(tp["local windows"])
    body = "\n\n".join([
        f"Tenants: `no rate limit` (in-flight slot only); `local windows` (a tenant limit and a per-model limit, "
        f"in-process sliding windows, no Redis); `local + Redis` (the same plus the shared window: one Lua script "
        f"call per request to {server_name} {version} on loopback). Limits are set so every request is admitted. "
        f"Variants alternate round by round.",
        "### Per request, in process (sequential; µs of wall time)",
        table(["tenant", "admit+release p50 µs", "p99 µs", "CPU µs", "p50 vs local",
               "RequestFlow message + finish p50 µs", "p99 µs", "CPU µs", "p50 vs local"], rows),
        "`CPU µs` is this process's CPU time per request (the Redis server's own work is not in it).",
        f"### ext_proc throughput at concurrency {args.concurrency}",
        f"The real `ExtProcServicer` (grpc.aio) runs in its own process; one grpc.aio client process keeps "
        f"{args.concurrency} streams open at once, each sending the buffered body (with the request "
        f"attributes), then ending the stream (as Envoy does when the HTTP stream ends). "
        f"Server CPU is that process's share of one core; the client competes for the same 2 cores.",
        table(["tenant", "streams/s", "vs local", "stream p50 ms", "stream p99 ms", "ext_proc CPU (of 1 core)",
               "ext_proc CPU µs/stream", "streams/s at 1 full core", "Redis CPU", "not admitted"], tp_rows),
        "`streams/s at 1 full core` is 1 / (ext_proc CPU per stream): the servicer's ceiling if the client were "
        "not sharing the machine. When `ext_proc CPU` is well under 100%, the measured streams/s is bounded by the "
        "client process and the shared cores, not by ext_proc.",
        f"Reading: in process, the shared window makes one admission decision {redis_decision:.0f}x as long as "
        f"the local windows alone (on average +{redis_decision_us:.0f} µs of wall time, of which "
        f"{redis_decision_cpu_us:.0f} µs is this process's own CPU in the redis-py client) and the whole "
        f"per-request flow {redis_flow:.1f}x as long. At concurrency {args.concurrency}, ext_proc throughput with "
        f"Redis is {redis_tp:.2f}x the "
        f"local-only figure and ext_proc's CPU per stream is {redis_cpu:.2f}x ({redis_cpu_us:+.0f} µs). "
        + ("The Redis call's cost is mostly client-side CPU in the event loop, so it lowers a replica's ceiling "
           "rather than only adding latency."
           if redis_decision_cpu_us > redis_decision_us / 2 else
           "The Redis call's cost is mostly waiting, which other streams use, so it adds latency more than it "
           "lowers a replica's ceiling."),
    ])
    print(body)
    if not args.no_write:
        write_section("admission", "Admission cost: local windows vs Redis", COMMAND, body)


if __name__ == "__main__":
    main()
