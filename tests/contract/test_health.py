"""grpc.health.v1 on the ext_proc and xDS servers: ready only when able to do the job,
NOT_SERVING from the moment they drain (which Envoy's health checks and Kubernetes'
gRPC probes act on)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modeldock.config import hash_key, parse_config
from modeldock.extproc.app import ExtProcOptions, ExtProcServer
from modeldock.up import free_port
from modeldock.xds.app import XdsOptions, XdsServer

KEY = "health-key"
DATA = {
    "tenants": [{"id": "t", "api_key_hashes": [hash_key(KEY)], "models": ["m"]}],
    "models": [{"name": "m", "endpoints": ["127.0.0.1:9001"]}],
}
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
EXTPROC = "envoy.service.ext_proc.v3.ExternalProcessor"
ADS = "envoy.service.discovery.v3.AggregatedDiscoveryService"


async def status(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                timeout=2)
        return reply.status


def body() -> ep.ProcessingRequest:
    msg = ep.ProcessingRequest(request_body=ep.HttpBody(body=json.dumps({"model": "m"}).encode(), end_of_stream=True))
    msg.attributes["envoy.filters.http.ext_proc"].update({
        "request.method": "POST", "request.path": "/v1/completions",
        "request.headers['authorization']": f"Bearer {KEY}"})
    return msg


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(DATA))
    return path


async def test_extproc_is_ready_once_synced_with_xds_and_not_serving_while_draining(config_path: Path) -> None:
    config = parse_config(DATA)
    # ext_proc first, against an xDS port nothing listens on yet: up, but not ready.
    xds_port = free_port()
    xds = XdsServer(config, XdsOptions(config_path, port=xds_port, tick_seconds=0.05))
    ext = ExtProcServer(config, ExtProcOptions(f"127.0.0.1:{xds_port}", port=0, drain_delay=0.5))
    await ext.start()
    try:
        assert await status(ext.bound_port) == NOT_SERVING
        assert await status(ext.bound_port, EXTPROC) == NOT_SERVING
        await xds.start()
        await asyncio.wait_for(ext.xds.synced.wait(), 10)
        for _ in range(50):
            if await status(ext.bound_port) == SERVING:
                break
            await asyncio.sleep(0.02)
        assert await status(ext.bound_port) == SERVING
        assert await status(ext.bound_port, EXTPROC) == SERVING

        async with grpc.aio.insecure_channel(f"127.0.0.1:{ext.bound_port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)
            stopping = asyncio.create_task(ext.stop(grace=1.0))
            await asyncio.sleep(0.1)
            # Draining: reported at once, while new streams are still served for drain_delay.
            health = health_pb2_grpc.HealthStub(channel)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=EXTPROC), timeout=2)
            assert reply.status == NOT_SERVING
            call = stub.Process()
            await call.write(body())
            assert (await call.read()).WhichOneof("response") == "request_body"
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            await asyncio.wait_for(stopping, 5)
        assert ext.picker.total_in_flight() == 0
    finally:
        await ext.stop(0.1)
        await xds.stop(0.1)


async def test_xds_is_ready_once_serving_and_not_serving_once_stopping(config_path: Path) -> None:
    xds = XdsServer(parse_config(DATA), XdsOptions(config_path, port=0, tick_seconds=0.05))
    await xds.start()
    try:
        assert await status(xds.bound_port) == SERVING
        assert await status(xds.bound_port, ADS) == SERVING
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await status(xds.bound_port, "no.such.Service")
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        async with grpc.aio.insecure_channel(f"127.0.0.1:{xds.bound_port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=ADS))
            assert (await watch.read()).status == SERVING
            stopping = asyncio.create_task(xds.stop(0.5))
            assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
            await stopping
    finally:
        await xds.stop(0.1)
