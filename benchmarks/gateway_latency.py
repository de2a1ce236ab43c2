"""Added latency of the gateway, side by side in one run.

Four paths to the same simulator, interleaved round by round so machine noise
hits them alike:
  direct         client -> simulator
  envoy          client -> Envoy (static cluster, no ext_proc) -> simulator
  floor          client -> Envoy with modeldock's bootstrap (+ xDS) and an ext_proc
                 that answers with constant messages (grpc.aio, no modeldock logic)
  gateway        client -> Envoy + modeldock ext_proc (+ xDS) -> simulator
floor vs gateway is what modeldock's own code costs; envoy vs floor is the price
of any Python grpc.aio ext_proc on this design (one message per request).
Token budgets and usage records, interleaved with the above (ext_proc CPU per request
against `gateway`, a tenant with no budget and usage records off, as before them):
  budgets-local  a tenant with tokens_per_minute on the same gateway (local windows)
  budgets-redis  the same tenant on a second gateway whose budgets are in Redis
  records        a tenant with no budget on a third gateway with usage records on
Reports end-to-end p50/p99 of a one-token streamed completion at several
concurrencies, ext_proc CPU-seconds per 1,000 requests (Envoy's for scale), and
ext_proc RSS with 1,000 streams open.

    .venv/bin/python -m benchmarks.gateway_latency [--requests 500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import yaml

from benchmarks._proc import cpu_seconds, rss_mb
from benchmarks._report import table, write_section
from modeldock.bench import BenchOptions, run_benchmark
from modeldock.bench.metrics import e2e
from modeldock.bench.stats import nearest_rank
from modeldock.config import hash_key
from modeldock.devstack.redis_server import RedisServer
from modeldock.devstack.stack import API_KEY, Stack, running_stack, wait_until
from modeldock.envoy import BootstrapOptions, envoy_binary, render_bootstrap
from modeldock.up import Child, Supervisor, free_port

BUDGET_KEY = "md-bench-budgeted-tenant-key"


def _budgeted(usage_dir: Path | None = None) -> object:
    """edit_config: a tenant with a (never binding) token budget; usage records into `usage_dir` if given."""
    def edit(data: dict[str, object], _sims: object) -> None:
        data["tenants"].append({"id": "budgeted", "api_key_hashes": [hash_key(BUDGET_KEY)],  # type: ignore[attr-defined]
                                "models": ["demo-*"], "tokens_per_minute": 10**12, "tokens_per_day": 10**12})
        if usage_dir is not None:
            data["usage"] = {"path": str(usage_dir / "usage.jsonl")}
    return edit


ENVOY_ONLY = ("""
admin: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}}}
static_resources:
  listeners:
  - address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: plain
          delayed_close_timeout: 0s
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes: [{{match: {{prefix: "/"}}, route: {{cluster: sim, timeout: 0s}}}}]
  clusters:
  - name: sim
    type: STATIC
    connect_timeout: 1s
    circuit_breakers: {{thresholds: [{{max_connections: 100000, max_pending_requests: 100000, max_requests: 100000}}]}}
    load_assignment:
      cluster_name: sim
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: """
              """{{socket_address: {{address: 127.0.0.1, port_value: {sim}}}}}}}}}]}}]
""")


async def serve_floor(route_to: str) -> None:
    """An ext_proc that routes every request to `route_to` with constant answers."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    from modeldock import replies
    from modeldock.extproc import responses
    from modeldock.extproc.wire import add_servicer

    body = responses.route_request_body("model:demo-model", route_to, model="demo-model")

    class Floor(ep_grpc.ExternalProcessorServicer):
        async def Process(self, _requests, context):  # type: ignore[no-untyped-def]  # noqa: N802
            while (request := await context.read()) is not grpc.aio.EOF:
                kind = request.WhichOneof("request")
                await context.write(body if kind == "request_body" else replies.continue_other(request))

    server = grpc.aio.server()
    add_servicer(Floor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


def start_floor(sup: Supervisor, stack: Stack, tmp: Path) -> tuple[str, int, int]:
    """The floor ext_proc and an Envoy with the gateway's bootstrap in front of it; (url, ext_proc pid, envoy pid)."""
    proc = subprocess.Popen([sys.executable, __file__, "--serve-floor", stack.sims[0].address], stdout=subprocess.PIPE,
                            text=True)
    sup.children.append(Child("floor-extproc", proc, tmp / "floor-extproc.log"))  # type: ignore[arg-type]
    extproc_port = int(proc.stdout.readline())  # type: ignore[union-attr]
    gateway_bootstrap = yaml.safe_load((stack.run_dir / "envoy.yaml").read_text())
    xds = next(c for c in gateway_bootstrap["static_resources"]["clusters"] if c["name"] == "modeldock_xds")
    xds_port = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
        "port_value"]
    port, admin = free_port(), free_port()
    path = tmp / "floor.yaml"
    path.write_text(render_bootstrap(BootstrapOptions(listen_port=port, admin_port=admin, xds_port=xds_port,
                                                      extproc_port=extproc_port, node_id="modeldock-floor")))
    envoy = sup.start("envoy-floor", [envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--log-level", "warn"])
    wait_until(lambda: _up(f"http://127.0.0.1:{admin}/ready"), 20, what="floor Envoy")
    return f"http://127.0.0.1:{port}/v1", proc.pid, envoy.proc.pid


def pid_of(stack: Stack, name: str) -> int:
    return next(c.proc.pid for c in stack.sup.children if c.name == name)


async def measure(url: str, token: str | None, concurrency: int, requests: int) -> tuple[list[float], int]:
    result = await run_benchmark(BenchOptions(
        url=url, model="demo-model", requests=requests, concurrency=(concurrency,), warmup=min(50, requests // 5),
        prompt_tokens=8, max_tokens=1, token=token, timeout=30))
    tier = result.tiers[0]
    return [v for r in tier.records if r.completed and (v := e2e(r)) is not None], tier.error_total


def pct(values: list[float], p: float) -> float:
    """The nearest-rank p-th percentile in milliseconds (NaN for no values): modeldock.bench's rule."""
    return nearest_rank(values, p) * 1000 if values else float("nan")


async def open_streams(url: str, count: int) -> tuple[aiohttp.ClientSession, list[asyncio.Task[None]]]:
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=count + 10))
    started = asyncio.Event()
    opened = 0

    async def one() -> None:
        nonlocal opened
        async with session.post(f"{url}/completions", json={"model": "demo-model", "prompt": "x", "max_tokens": 8000,
                                                             "stream": True},
                                headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
            await resp.content.readline()
            opened += 1
            if opened == count:
                started.set()
            async for _ in resp.content:
                pass

    tasks = [asyncio.create_task(one()) for _ in range(count)]
    await asyncio.wait_for(started.wait(), 120)
    return session, tasks


async def main_async(args: argparse.Namespace) -> None:
    tiers = [int(c) for c in args.concurrency.split(",")]
    sim_args = ("--speed", "1000", "--max-num-seqs", "2048", "--num-gpu-blocks", "200000")
    redis = RedisServer()
    redis.start()
    with tempfile.TemporaryDirectory() as tmp, running_stack(
        Path(tmp) / "stack", backends=1, sim_args=sim_args, log_level="info", edit_config=_budgeted(),
    ) as stack, running_stack(
        Path(tmp) / "redis-stack", backends=1, sim_args=sim_args, log_level="info", edit_config=_budgeted(),
        extproc_env={"REDIS_URL": redis.url},
    ) as redis_stack, running_stack(
        Path(tmp) / "records-stack", backends=1, sim_args=sim_args, log_level="info",
        edit_config=_budgeted(Path(tmp)),
    ) as records_stack:
        sim = stack.sims[0]
        envoy_port, envoy_admin = free_port(), free_port()
        plain = Path(tmp) / "plain.yaml"
        plain.write_text(ENVOY_ONLY.format(admin=envoy_admin, port=envoy_port, sim=sim.port))
        sup = Supervisor(Path(tmp))
        sup.start("envoy-plain", [envoy_binary(), "-c", str(plain), "--use-dynamic-base-id", "--log-level", "warn"])
        try:
            wait_until(lambda: _up(f"http://127.0.0.1:{envoy_admin}/ready"), 20, what="plain Envoy")
            floor_url, floor_pid, floor_envoy_pid = start_floor(sup, stack, Path(tmp))
            paths = {
                "direct": (f"{sim.url}/v1", None),
                "envoy": (f"http://127.0.0.1:{envoy_port}/v1", None),
                "floor": (floor_url, None),
                "gateway": (stack.base_url, API_KEY),
                "budgets-local": (stack.base_url, BUDGET_KEY),
                "budgets-redis": (redis_stack.base_url, BUDGET_KEY),
                "records": (records_stack.base_url, API_KEY),
            }
            pids = {"extproc": pid_of(stack, "extproc"), "envoy": pid_of(stack, "envoy"),
                    "extproc-redis": pid_of(redis_stack, "extproc"), "redis": redis.pid or 0,
                    "extproc-records": pid_of(records_stack, "extproc"),
                    "envoy-plain": next(c.proc.pid for c in sup.children if c.name == "envoy-plain"),
                    "floor": floor_pid, "envoy-floor": floor_envoy_pid}
            # The processes whose CPU each path's requests are charged to.
            charged = {"envoy": ("envoy-plain",), "floor": ("floor", "envoy-floor"), "gateway": ("extproc", "envoy"),
                       "budgets-local": ("budgets-local",), "budgets-redis": ("extproc-redis", "redis"),
                       "records": ("extproc-records",)}
            pids["budgets-local"] = pids["extproc"]  # the same process as `gateway`, charged apart
            samples: dict[tuple[str, int], list[float]] = {}
            errors: dict[str, int] = {name: 0 for name in paths}
            cpu: dict[tuple[str, int], float] = {}
            sent: dict[int, int] = {}
            # One tier at a time, paths interleaved round by round (in reverse every other round):
            # a concurrency-1 tier measured right after a concurrency-64 one came out 0.4 ms slower
            # on every path with ext_proc, as the processes worked off the burst.
            for c in tiers:
                await asyncio.sleep(args.settle)
                for round_ in range(args.rounds):
                    sent[c] = sent.get(c, 0) + args.requests + min(50, args.requests // 5)
                    order = list(paths.items())
                    for name, (url, token) in (order if round_ % 2 == 0 else order[::-1]):
                        before = {p: cpu_seconds(pids[p]) for p in charged.get(name, ())}
                        lat, errs = await measure(url, token, c, args.requests)
                        for p, start in before.items():
                            cpu[(p, c)] = cpu.get((p, c), 0.0) + cpu_seconds(pids[p]) - start
                        samples.setdefault((name, c), []).extend(lat)
                        errors[name] += errs
            rss_idle = rss_mb(pids["extproc"])
            session, tasks = await open_streams(stack.base_url, args.streams)
            await asyncio.sleep(1)
            rss_open = rss_mb(pids["extproc"])
            streams_open = stack.metric("modeldock_extproc_streams")
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await session.close()
            wait_until(lambda: stack.in_flight() == 0, 30, what="streams released")
        finally:
            sup.stop_all()
            redis.close()

    rows = []
    for c in tiers:
        d, e, f, g = (samples[(n, c)] for n in ("direct", "envoy", "floor", "gateway"))
        rows.append([
            c,
            f"{pct(d, 50):.2f} / {pct(d, 99):.2f}",
            f"{pct(e, 50):.2f} / {pct(e, 99):.2f}",
            f"{pct(f, 50):.2f} / {pct(f, 99):.2f}",
            f"{pct(g, 50):.2f} / {pct(g, 99):.2f}",
            f"{pct(e, 50) - pct(d, 50):+.2f} / {pct(e, 99) - pct(d, 99):+.2f}",
            f"{pct(g, 50) - pct(e, 50):+.2f} / {pct(g, 99) - pct(e, 99):+.2f}",
            f"{pct(f, 50) - pct(e, 50):+.2f} / {pct(f, 99) - pct(e, 99):+.2f}",
            f"{pct(g, 50) - pct(f, 50):+.2f} / {pct(g, 99) - pct(f, 99):+.2f}",
        ])
    per_k = {k: v / sent[k[1]] * 1000 for k, v in cpu.items()}
    cpu_rows = [[c, f"{per_k[('extproc', c)]:.3f}", f"{per_k[('floor', c)]:.3f}",
                 f"{per_k[('extproc', c)] / per_k[('floor', c)]:.2f}x", f"{per_k[('envoy', c)]:.3f}",
                 f"{per_k[('envoy-plain', c)]:.3f}"] for c in tiers]
    total = {p: sum(v for (q, _), v in cpu.items() if q == p) / sum(sent.values()) * 1000
             for p in ("extproc", "floor", "envoy", "envoy-plain")}
    def per_request_ms(process: str, c: int | None = None) -> float:
        if c is None:
            return sum(v for (q, _), v in cpu.items() if q == process) / sum(sent.values()) * 1000
        return cpu[(process, c)] / sent[c] * 1000

    budget_rows = []
    for label, process in (("no budget, records off (gateway)", "extproc"),
                           ("budgets, local windows", "budgets-local"),
                           ("budgets, Redis windows", "extproc-redis"),
                           ("no budget, usage records on", "extproc-records")):
        cells = [f"{per_request_ms(process, c):.3f} ({per_request_ms(process, c) / per_request_ms('extproc', c):.2f}x)"
                 for c in tiers]
        overall = per_request_ms(process)
        budget_rows.append([label, *cells, f"{overall:.3f} ({overall / per_request_ms('extproc'):.2f}x)",
                            f"{overall / per_request_ms('floor'):.2f}x"])
    redis_ms = per_request_ms("redis")
    body = "\n\n".join([
        "End-to-end latency of a one-token streamed chat completion, in ms as p50 / p99 (nearest rank), "
        f"{args.requests} requests per tier per round; tiers run one after another ({args.settle:g} s idle "
        f"before each), and within a tier the four paths alternate over {args.rounds} rounds. The backend is one "
        "simulator at 1000x speed, so nearly all of the time is the path itself. `floor` is the gateway's own "
        "Envoy bootstrap with an ext_proc that answers every message with a constant (grpc.aio, no modeldock "
        "logic): what any Python ext_proc costs on this one-message design.",
        table(["concurrency", "direct", "Envoy alone", "floor", "gateway", "Envoy − direct", "gateway − Envoy",
               "floor − Envoy", "gateway − floor"], rows),
        "CPU-seconds per 1,000 requests, by concurrency (the same requests as above, warm-up included; the "
        "clock-tick resolution is 10 ms over a few seconds of CPU per cell):",
        table(["concurrency", "modeldock ext_proc", "floor ext_proc", "modeldock ÷ floor", "gateway's Envoy",
               "Envoy alone"], cpu_rows),
        table(["measure", "value"], [
            ["ext_proc CPU-seconds per 1,000 requests, all tiers (floor ext_proc)",
             f"{total['extproc']:.3f} ({total['floor']:.3f})"],
            ["gateway's Envoy / Envoy alone, all tiers", f"{total['envoy']:.3f} / {total['envoy-plain']:.3f}"],
            [f"ext_proc RSS idle → with {int(streams_open)} streams open", f"{rss_idle:.0f} MB → {rss_open:.0f} MB"],
            ["errors (direct / Envoy / gateway)", f"{errors['direct']} / {errors['envoy']} / {errors['gateway']}"],
        ]),
        "Token budgets and usage records: ext_proc CPU-milliseconds per request, and the ratio to the "
        "no-budget path of the same run (the same requests, interleaved with the paths above). Budgeted "
        "requests are streamed one-token completions, so each also asks the backend for usage (a body "
        "rewrite) and is settled from Envoy's usage log. Targets: no-budget tenants within +10 % of "
        "before (compare `÷ floor` with the modeldock ÷ floor figures of earlier runs), budgeted within +25 %.",
        table(["path", *(f"c={c}" for c in tiers), "all tiers", "÷ floor"], budget_rows),
        f"Redis server CPU per budgeted request: {redis_ms:.3f} ms. Errors: budgets local "
        f"{errors['budgets-local']}, Redis {errors['budgets-redis']}, records {errors['records']}.",
    ])
    print(body)
    if not args.no_write:
        write_section("gateway-latency", "Gateway added latency, ext_proc CPU and memory",
                      ".venv/bin/python -m benchmarks.gateway_latency", body)


def _up(url: str) -> bool:
    import urllib.request

    try:
        return urllib.request.urlopen(url, timeout=0.5).status == 200  # noqa: S310
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=500, help="measured requests per tier per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=2.0, help="idle seconds before each concurrency tier")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--streams", type=int, default=1000, help="streams held open for the RSS figure")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/benchmarks.md")
    parser.add_argument("--serve-floor", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_floor:
        asyncio.run(serve_floor(args.serve_floor))
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
