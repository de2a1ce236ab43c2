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
from google.protobuf import json_format, message, struct_pb2

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
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
ATTR = "envoy.filters.http.ext_proc"
AUTH = "request.headers['authorization']"


def _attributes(msg: ep.ProcessingRequest, values: dict[str, str]) -> ep.ProcessingRequest:
    struct = struct_pb2.Struct()
    struct.update(values)
    msg.attributes[ATTR].CopyFrom(struct)
    return msg


def _body(payload: bytes, key: str | None = KEY, path: str = "/v1/completions",
          authorization: str | None = None) -> ep.ProcessingRequest:
    """A completion request as Envoy sends it: the buffered body with the request attributes."""
    values = {"request.method": "POST", "request.path": path, "request.id": "c-1"}
    if authorization is not None or key is not None:
        values[AUTH] = authorization if authorization is not None else f"Bearer {key}"
    return _attributes(ep.ProcessingRequest(request_body=ep.HttpBody(body=payload, end_of_stream=True)), values)


def _response(status: int, upstream: str | None = None, path: str = "/v1/completions",
              method: str = "POST") -> ep.ProcessingRequest:
    values = {"request.method": method, "request.path": path}
    if upstream is not None:
        values["upstream.address"] = upstream
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())])
    return _attributes(ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=hm)), values)


def _headers(*pairs: tuple[str, str]) -> ep.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm, end_of_stream=True))


def _error(resp: ep.ProcessingResponse) -> tuple[int, str]:
    assert resp.WhichOneof("response") == "immediate_response", resp
    imm = resp.immediate_response
    assert {h.header.key: h.header.raw_value for h in imm.headers.set_headers}["content-type"] == b"application/json"
    err = json.loads(imm.body)["error"]
    assert err["message"] and err["param"] is None, err
    assert err["type"] == {429: "rate_limit_error", 503: "server_error"}.get(imm.status.code, "invalid_request_error")
    return imm.status.code, err["code"]


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
            # No request_headers: the body message carries the request's attributes.
            await call.write(_body(json.dumps({"model": "m", "prompt": "x"}).encode()))
            first = await call.read()
            assert first.WhichOneof("response") == "request_body"
            common = first.request_body.response
            assert common.clear_route_cache and common.HasField("header_mutation")
            assert not common.header_mutation.set_headers and not common.header_mutation.remove_headers
            assert not common.HasField("body_mutation")
            meta = json_format.MessageToDict(first.dynamic_metadata)
            assert meta["modeldock"] == {"cluster": "model:m"}
            endpoints = meta["envoy.lb"]["x-gateway-destination-endpoint"].split(",")
            assert sorted(endpoints) == ["127.0.0.1:9001", "127.0.0.1:9002"]
            assert ext.picker.in_flight(Endpoint.parse(endpoints[0])) == ext.picker.total_in_flight() == 1
            # Envoy retried on the other endpoint: the count follows it.
            await call.write(_response(200, upstream=endpoints[1]))
            second = await call.read()
            assert second.WhichOneof("response") == "response_headers"
            assert ext.picker.in_flight(Endpoint.parse(endpoints[1])) == ext.picker.total_in_flight() == 1
            if cancel:
                call.cancel()
            else:
                await call.done_writing()
                assert await call.read() is grpc.aio.EOF
            await _wait(lambda: ext.picker.total_in_flight() == 0)


async def test_requests_that_are_not_completions(servers) -> None:
    """The model list (the one route whose headers are sent), Envoy's own 404 for a request without a body, its
    413 for a body over the buffer, and a message out of order: each a JSON answer, on a fresh stream each."""
    _, ext, _ = servers
    cases: list[tuple[ep.ProcessingRequest, tuple[int, str] | None]] = [
        (_headers((":method", "GET"), (":path", "/v1/models"), ("authorization", f"Bearer {KEY}")), None),
        (_headers((":method", "GET"), (":path", "/v1/models")), (401, "missing_api_key")),
        (_response(404, path="/v1/embeddings", method="GET"), (404, "unknown_url")),
        (_response(404, path="/v1/completions", method="GET"), (400, "method_not_allowed")),
        (_response(404, path="/v1/completions"), (400, "invalid_body")),
        (_response(413), (413, "request_too_large")),
        (ep.ProcessingRequest(request_trailers=ep.HttpTrailers()), (400, "invalid_request")),
        (_body(b'{"model":"m"}', key=None), (401, "missing_api_key")),
        (_body(b'{"model":"m"}', key="wrong"), (401, "invalid_api_key")),
        # Two Authorization headers, as Envoy joins them into the attribute.
        (_body(b'{"model":"m"}', authorization=f"Bearer {KEY},Bearer {KEY}"), (401, "invalid_authorization")),
    ]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ext.bound_port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        for msg, expected in cases:
            call = stub.Process()
            await call.write(msg)
            resp = await call.read()
            if expected is None:
                assert resp.immediate_response.status.code == 200
                assert [m["id"] for m in json.loads(resp.immediate_response.body)["data"]] == ["m"]
            else:
                assert _error(resp) == expected, msg
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
        # Envoy's reply to something else goes on unchanged.
        call = stub.Process()
        await call.write(_response(503))
        resp = await call.read()
        assert resp.WhichOneof("response") == "response_headers"
        assert not resp.response_headers.response.HasField("header_mutation")
        await call.done_writing()
    assert ext.picker.total_in_flight() == 0


async def test_authorization_attribute_that_is_not_utf8_is_a_401(servers) -> None:
    """The server decodes requests upb would refuse (Envoy copies header bytes into a protobuf string)."""
    _, ext, _ = servers
    marker = "Bearer " + "#" * 12
    raw = _body(b'{"model":"m"}', key=None)
    raw.attributes[ATTR].fields[AUTH].string_value = marker
    data = raw.SerializeToString().replace(marker.encode(), b"Bearer \xff\xfe" + b"k" * 10)
    with pytest.raises(message.DecodeError):
        ep.ProcessingRequest.FromString(data)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ext.bound_port}") as channel:
        call = channel.stream_stream(PROCESS, request_serializer=lambda b: b,
                                     response_deserializer=ep.ProcessingResponse.FromString)()
        await call.write(data)
        resp = await call.read()
        assert resp is not grpc.aio.EOF, f"stream broken: {await call.code()} {await call.details()}"
        assert _error(resp) == (401, "invalid_api_key")
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    assert ext.picker.total_in_flight() == 0


async def test_staleness_reaches_extproc_as_503(servers) -> None:
    xds, ext, _ = servers
    # Stop confirmations: the static source task is the only confirmer.
    for task in xds._tasks:
        if task.get_name() == "static-discovery":
            task.cancel()
    await _wait(lambda: "m" in ext.gateway.stale_models, 5)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{ext.bound_port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        await call.write(_body(b'{"model":"m"}'))
        resp = await call.read()
        assert _error(resp) == (503, "endpoint_snapshot_stale")
        assert json.loads(resp.immediate_response.body)["error"]["type"] == "server_error"
        call.cancel()
    assert ext.picker.total_in_flight() == 0


async def test_extproc_stops_dispatching_when_xds_is_gone_too_long(servers) -> None:
    xds, ext, _ = servers
    await xds.stop(0)
    await _wait(lambda: ext.xds.disconnected_for() > 1.0, 5)
    with pytest.raises(Exception) as info:
        ext.gateway.pick("m")
    assert getattr(info.value, "code", "") == "endpoint_snapshot_stale"
