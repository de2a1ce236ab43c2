"""Picker mode over real gRPC: the health service names the gateways probe, and a whole
FULL_DUPLEX_STREAMED request through `ExtProcServer` (the answers in the order Envoy needs them);
requests settled with the usage read from their responses, each under its own key."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import yaml
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from modeldock.config import hash_key, parse_config
from modeldock.epp import PickerOptions
from modeldock.epp.protocol import HEALTH_SERVICES
from modeldock.extproc.app import ExtProcOptions, ExtProcServer
from modeldock.up import free_port
from modeldock.xds.app import XdsOptions, XdsServer
from tests.support.extproc_messages import headers_request, raw_headers

KEY = "picker-key"
DATA = {
    "tenants": [{"id": "t", "api_key_hashes": [hash_key(KEY)], "models": ["m"]}],
    "models": [{"name": "m", "endpoints": ["127.0.0.1:9001", "127.0.0.1:9002"]}],
}


async def status(channel: grpc.aio.Channel, service: str) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
    return int(reply.status)


async def test_picker_mode_serves_the_health_names_and_a_duplex_request(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(DATA))
    config = parse_config(DATA)
    xds_port = free_port()
    xds = XdsServer(config, XdsOptions(path, port=xds_port, tick_seconds=0.05))
    ext = ExtProcServer(config, ExtProcOptions(f"127.0.0.1:{xds_port}", port=0, picker=PickerOptions(fallbacks=True)))
    await ext.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ext.bound_port}") as channel:
            for service in ("", *HEALTH_SERVICES):
                assert await status(channel, service) == health_pb2.HealthCheckResponse.NOT_SERVING
            await xds.start()
            await asyncio.wait_for(ext.xds.synced.wait(), 10)
            for _ in range(100):
                if await status(channel, "readiness") == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.02)
            for service in ("", *HEALTH_SERVICES):
                assert await status(channel, service) == health_pb2.HealthCheckResponse.SERVING, service

            start = headers_request(raw_headers((":method", "POST"), (":path", "/v1/completions"),
                                                ("authorization", f"Bearer {KEY}")), end_of_stream=False)
            start.protocol_config.request_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
            start.protocol_config.response_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
            body = json.dumps({"model": "m", "prompt": "hi"}).encode()
            call = ep_grpc.ExternalProcessorStub(channel).Process()
            await call.write(start)
            await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body[:5], end_of_stream=False)))
            await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body[5:], end_of_stream=True)))
            first = await asyncio.wait_for(call.read(), 5)
            assert first.WhichOneof("response") == "request_headers"
            lb = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields
            assert sorted(lb["x-gateway-destination-endpoint"].string_value.split(",")) == [
                "127.0.0.1:9001", "127.0.0.1:9002"]
            echoed = await asyncio.wait_for(call.read(), 5)
            assert echoed.request_body.response.body_mutation.streamed_response.body == body
            assert ext.picker.total_in_flight() == 1
            await call.done_writing()
            assert await asyncio.wait_for(call.read(), 5) == grpc.aio.EOF
            for _ in range(100):
                if ext.picker.total_in_flight() == 0:
                    break
                await asyncio.sleep(0.02)
            assert ext.picker.total_in_flight() == 0
    finally:
        await ext.stop(grace=0.5)
        await xds.stop()


USAGE_EVENT = b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":6}}\n\n'
CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'


async def stream_one(stub: ep_grpc.ExternalProcessorStub, body: bytes) -> bytes:
    """One streaming request and its SSE response through the picker; what the client gets back."""
    call = stub.Process()
    start = headers_request(raw_headers((":method", "POST"), (":path", "/v1/completions"),
                                        ("authorization", f"Bearer {KEY}")), end_of_stream=False)
    start.protocol_config.request_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
    start.protocol_config.response_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
    await call.write(start)
    await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
    assert (await asyncio.wait_for(call.read(), 5)).WhichOneof("response") == "request_headers"
    await asyncio.wait_for(call.read(), 5)  # the body echoed
    await call.write(headers_request(raw_headers((":status", "200"), ("content-type", "text/event-stream")),
                                     end_of_stream=False, field="response_headers"))
    assert (await asyncio.wait_for(call.read(), 5)).WhichOneof("response") == "response_headers"
    got = b""
    for piece, end in ((CONTENT + USAGE_EVENT[:20], False), (USAGE_EVENT[20:] + b"data: [DONE]\n\n", True)):
        await call.write(ep.ProcessingRequest(response_body=ep.HttpBody(body=piece, end_of_stream=end)))
        answer = await asyncio.wait_for(call.read(), 5)
        got += answer.response_body.response.body_mutation.streamed_response.body
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 5) == grpc.aio.EOF
    return got


async def test_picker_mode_settles_each_request_under_its_own_key_with_the_usage_of_its_response(
        tmp_path: Path) -> None:
    data = {**DATA, "usage": {"path": str(tmp_path / "usage.jsonl"), "replica": "p", "fsync_interval_seconds": 0}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    config = parse_config(data)
    xds_port = free_port()
    xds = XdsServer(config, XdsOptions(path, port=xds_port, tick_seconds=0.05))
    ext = ExtProcServer(config, ExtProcOptions(f"127.0.0.1:{xds_port}", port=0, picker=PickerOptions()))
    records = tmp_path / "usage.p.jsonl"
    await ext.start()
    await xds.start()
    try:
        await asyncio.wait_for(ext.xds.synced.wait(), 10)
        body = json.dumps({"model": "m", "prompt": "hi", "stream": True}).encode()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ext.bound_port}") as channel:
            stub = ep_grpc.ExternalProcessorStub(channel)
            for _ in range(3):
                assert await stream_one(stub, body) == CONTENT + b"data: [DONE]\n\n"  # usage: not asked for
        lines: list[dict[str, object]] = []
        for _ in range(100):
            lines = [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []
            if len(lines) == 3:
                break
            await asyncio.sleep(0.02)
        assert len({line["request_id"] for line in lines}) == 3
        assert all((line["prompt_tokens"], line["completion_tokens"], line["token_source"]) == (4, 6, "reported")
                   for line in lines)
    finally:
        await ext.stop(grace=0.5)
        await xds.stop()
