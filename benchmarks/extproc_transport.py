"""What a do-nothing Python ext_proc costs per request, by gRPC stack, driven by real Envoy.

One Envoy (one worker) with four listeners in front of the same upstream (an Envoy
direct response, so the upstream costs no Python):
  plain      no ext_proc
  grpc.aio   ext_proc in modeldock's processing mode (the buffered body with request
             attributes, then response headers), answered with constants by grpc.aio
  grpclib    the same, answered by grpclib (pure-Python HTTP/2 on asyncio)
  grpclib+uvloop  the same on uvloop
Rounds interleave the listeners. This is the floor under any Python ext_proc's cost:
modeldock's logic comes on top (see gateway_latency.py, "gateway - floor").

    .venv/bin/pip install grpclib uvloop   # not modeldock dependencies; rows are skipped without them
    .venv/bin/python -m benchmarks.extproc_transport
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._proc import cpu_seconds
from benchmarks._report import table, write_section
from modeldock.bench.stats import nearest_rank
from modeldock.envoy import envoy_binary
from modeldock.up import free_port

MODE = {"request_header_mode": "SKIP", "request_body_mode": "BUFFERED", "response_header_mode": "SKIP",
        "response_body_mode": "NONE"}
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k\r\n"
           b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY)) + BODY


def _router() -> dict[str, object]:
    return {"name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}


def _listener(name: str, port: int, cluster: str, extproc: str | None) -> dict[str, object]:
    filters: list[dict[str, object]] = []
    if extproc is not None:
        filters.append({"name": "envoy.filters.http.ext_proc", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": extproc}}, "processing_mode": MODE,
            "request_attributes": ["request.method", "request.path", "request.id",
                                   "request.headers['authorization']"],
            "forward_rules": {"allowed_headers": {"patterns": [{"exact": ":method"}]}}}})
    filters.append(_router())
    route = {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "ok"}}} \
        if cluster == "" else {"match": {"prefix": "/"}, "route": {"cluster": cluster}}
    return {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                         "HttpConnectionManager",
                "stat_prefix": name, "http_filters": filters,
                "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]}}}]}]}


def _cluster(name: str, port: int, h2: bool) -> dict[str, object]:
    address = {"socket_address": {"address": "127.0.0.1", "port_value": port}}
    cluster: dict[str, object] = {"name": name, "type": "STATIC", "load_assignment": {
        "cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}]}}
    if h2:
        cluster["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {"max_concurrent_streams": 100000}}}}
    return cluster


# ---------------------------------------------------------------- the servers (subprocesses)

def serve(kind: str, port: int) -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    answers = {"request_headers": ep.ProcessingResponse(request_headers=ep.HeadersResponse()),
               "request_body": ep.ProcessingResponse(request_body=ep.BodyResponse()),
               "response_headers": ep.ProcessingResponse(response_headers=ep.HeadersResponse())}
    if kind == "grpc.aio":
        import grpc
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

        class Floor(ep_grpc.ExternalProcessorServicer):
            async def Process(self, _requests, context):  # type: ignore[no-untyped-def]  # noqa: N802
                while (request := await context.read()) is not grpc.aio.EOF:
                    await context.write(answers[request.WhichOneof("request")])

        async def main() -> None:
            server = grpc.aio.server()
            ep_grpc.add_ExternalProcessorServicer_to_server(Floor(), server)
            server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            print("ready", flush=True)
            await server.wait_for_termination()
    else:
        import grpclib.const
        from grpclib.server import Server

        class GrpclibFloor:
            async def process(self, stream):  # type: ignore[no-untyped-def]
                async for request in stream:
                    await stream.send_message(answers[request.WhichOneof("request")])

            def __mapping__(self):  # type: ignore[no-untyped-def]  # noqa: N807
                return {"/envoy.service.ext_proc.v3.ExternalProcessor/Process": grpclib.const.Handler(
                    self.process, grpclib.const.Cardinality.STREAM_STREAM, ep.ProcessingRequest,
                    ep.ProcessingResponse)}

        async def main() -> None:
            server = Server([GrpclibFloor()])
            await server.start("127.0.0.1", port)
            print("ready", flush=True)
            await server.wait_closed()

        if kind == "grpclib+uvloop":
            import uvloop

            uvloop.install()
    asyncio.run(main())


# ---------------------------------------------------------------- the driver

async def _connection(port: int, n: int, latencies: list[float]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(n):
            started = time.perf_counter()
            writer.write(REQUEST)
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(head.decode(errors="replace"))
            latencies.append(time.perf_counter() - started)
    finally:
        writer.close()


async def drive(port: int, requests: int, concurrency: int) -> list[float]:
    latencies: list[float] = []
    await asyncio.gather(*(_connection(port, requests // concurrency, latencies) for _ in range(concurrency)))
    return sorted(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    kinds = ["grpc.aio"]
    if importlib.util.find_spec("grpclib"):
        kinds.append("grpclib")
        if importlib.util.find_spec("uvloop"):
            kinds.append("grpclib+uvloop")
    skipped = [k for k in ("grpclib", "grpclib+uvloop") if k not in kinds]
    servers: dict[str, subprocess.Popen[str]] = {}
    envoy: subprocess.Popen[bytes] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ports = {kind: free_port() for kind in kinds}
            for kind in kinds:
                servers[kind] = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port",
                                                  str(ports[kind])], stdout=subprocess.PIPE, text=True)
                servers[kind].stdout.readline()  # type: ignore[union-attr]
            upstream, admin = free_port(), free_port()
            listen = {"plain": free_port(), **{kind: free_port() for kind in kinds}}
            config = {
                "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
                "static_resources": {
                    "listeners": [_listener("upstream", upstream, "", None),
                                  *(_listener(name.replace("+", "_").replace(".", "_"), port, "upstream",
                                              None if name == "plain" else f"x_{name}")
                                    for name, port in listen.items())],
                    "clusters": [_cluster("upstream", upstream, False),
                                 *(_cluster(f"x_{kind}", ports[kind], True) for kind in kinds)]}}
            path = Path(tmp) / "envoy.json"
            path.write_text(json.dumps(config))
            envoy = subprocess.Popen([envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1",
                                      "-l", "error"])
            time.sleep(1.5)
            for name in listen:  # warm up every path
                asyncio.run(drive(listen[name], 200, 1))
            results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
            for _ in range(args.rounds):
                for c in (1, 16):
                    for name, port in listen.items():
                        pid = servers[name].pid if name in servers else envoy.pid
                        before = cpu_seconds(pid)
                        lat = asyncio.run(drive(port, args.requests, c))
                        cpu = (cpu_seconds(pid) - before) / len(lat) * 1000 if name in servers else 0.0
                        p50, p99 = nearest_rank(lat, 50) * 1000, nearest_rank(lat, 99) * 1000
                        results.setdefault((name, c), []).append((p50, p99, cpu))
        finally:
            if envoy is not None:
                envoy.terminate()
                envoy.wait()
            for proc in servers.values():
                proc.terminate()
                proc.wait()
    rows = []
    for c in (1, 16):
        plain = min(r[0] for r in results[("plain", c)])
        for name in kinds:
            best = min(results[(name, c)], key=lambda r: r[2])
            rows.append([c, name, f"{best[0]:.2f} / {best[1]:.2f}", f"{best[0] - plain:+.2f}", f"{best[2]:.3f}",
                         f"{best[2] / min(r[2] for r in results[('grpc.aio', c)]):.2f}"])
    body = "\n\n".join([
        "Envoy (one worker) in front of an Envoy direct response, with and without an ext_proc that answers "
        "modeldock's one message (the buffered body with request attributes) with "
        f"constants. {args.requests} requests per tier and round, {args.rounds} rounds interleaved, best round "
        "by CPU. CPU is the ext_proc process's, per request.",
        table(["concurrency", "ext_proc stack", "latency p50 / p99 ms", "p50 over no ext_proc, ms",
               "ext_proc CPU ms/request", "CPU vs grpc.aio"], rows),
        (f"Skipped (not installed): {', '.join(skipped)}. " if skipped else "")
        + "Reading: this is the floor under a Python ext_proc on the most favourable path (an instant, "
        "non-streaming upstream, one Envoy worker, no other filters), before any work is done. The gateway "
        "latency section's floor path, with modeldock's full bootstrap, a streaming simulator and Envoy's default "
        "workers, costs more; see docs/performance.md. grpclib and "
        "uvloop are not modeldock dependencies; modeldock uses grpc.aio as its design prescribes.",
    ])
    print(body)
    if skipped and not args.no_write:
        print("not writing docs/benchmarks.md without every stack: .venv/bin/pip install grpclib uvloop")
    elif not args.no_write:
        write_section("extproc-transport", "ext_proc floor by gRPC stack",
                      ".venv/bin/pip install grpclib uvloop && .venv/bin/python -m benchmarks.extproc_transport",
                      body)


if __name__ == "__main__":
    main()
