"""ext_proc and ADS over real gRPC in one process: server, client and stream lifetime."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from modeldock.config import hash_key, parse_config
from modeldock.discovery.snapshot import Endpoint
from modeldock.extproc.app import ExtProcOptions, ExtProcServer
from modeldock.xds.app import XdsOptions, XdsServer

KEY = "contract-key"
DATA = {
    "tenants": [{"id": "t", "api_key_hashes": [hash_key(KEY)], "models": ["m"]}],
    "models": [{"name": "m", "endpoints": ["127.0.0.1:9001", "127.0.0.1:9002"]}],
    "discovery": {"stale_after_seconds": 1.0},
}


def _headers(*pairs: tuple[str, str]) -> ep.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm))


async def _wait(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture
async def servers(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(DATA))
    config = parse_config(DATA)
    xds = XdsServer(config, XdsOptions(path, port=0, tick_seconds=0.05))
    await xds.start()
    ext = ExtProcServer(config, ExtProcOptions(f"127.0.0.1:{xds.bound_port}", port=0))
    await ext.start()
    await asyncio.wait_for(ext.xds.synced.wait(), 5)
    yield xds, ext, path
    await ext.stop(0.1)
    await xds.stop(0.1)


async def test_extproc_learns_endpoints_over_ads_and_follows_file_changes(servers) -> None:
    xds, ext, path = servers
    assert ext.picker.endpoints("m") == (Endpoint("127.0.0.1", 9001), Endpoint("127.0.0.1", 9002))
    data = dict(DATA, models=[{"name": "m", "endpoints": ["127.0.0.1:9003"]}])
    path.write_text(yaml.safe_dump(data))
    await _wait(lambda: ext.picker.endpoints("m") == (Endpoint("127.0.0.1", 9003),))


async def test_stream_end_releases_in_flight_and_cancel_too(servers) -> None:
    _, ext, _ = servers
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ext.bound_port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        for cancel in (False, True):
            call = stub.Process()
            await call.write(_headers((":method", "POST"), (":path", "/v1/completions"),
                                      ("authorization", f"Bearer {KEY}")))
            first = await call.read()
            assert first.WhichOneof("response") == "request_headers"
            await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(
                body=json.dumps({"model": "m", "prompt": "x"}).encode(), end_of_stream=True)))
            second = await call.read()
            assert second.WhichOneof("response") == "request_body"
            assert ext.picker.total_in_flight() == 1
            if cancel:
                call.cancel()
            else:
                await call.done_writing()
            await _wait(lambda: ext.picker.total_in_flight() == 0)


async def test_staleness_reaches_extproc_as_503(servers) -> None:
    xds, ext, _ = servers
    # Stop confirmations: the static source task is the only confirmer.
    for task in xds._tasks:
        if task.get_name() == "static-discovery":
            task.cancel()
    await _wait(lambda: "m" in ext.gateway.stale_models, 5)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ext.bound_port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        await call.write(_headers((":method", "POST"), (":path", "/v1/completions"),
                                  ("authorization", f"Bearer {KEY}")))
        await call.read()
        await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=b'{"model":"m"}', end_of_stream=True)))
        resp = await call.read()
        assert resp.immediate_response.status.code == 503
        assert json.loads(resp.immediate_response.body)["error"]["code"] == "endpoint_snapshot_stale"
        call.cancel()


async def test_extproc_stops_dispatching_when_xds_is_gone_too_long(servers) -> None:
    xds, ext, _ = servers
    await xds.stop(0)
    await _wait(lambda: ext.xds.disconnected_for() > 1.0, 5)
    with pytest.raises(Exception) as info:
        ext.gateway.pick("m")
    assert getattr(info.value, "code", "") == "endpoint_snapshot_stale"
