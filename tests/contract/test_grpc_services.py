"""ext_proc and ADS over real gRPC in one process: server, client and stream lifetime."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
import yaml
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import json_format, message

from modeldock.config import hash_key, parse_config
from modeldock.extproc.app import ExtProcOptions, ExtProcServer
from modeldock.types import Endpoint
from modeldock.xds.app import XdsOptions, XdsServer
from tests.support.extproc_messages import ATTR, AUTH, body_request, headers_request, raw_headers, retry_report

KEY = "contract-key"
DATA = {
    "tenants": [{"id": "t", "api_key_hashes": [hash_key(KEY)], "models": ["m"]}],
    "models": [{"name": "m", "endpoints": ["127.0.0.1:9001", "127.0.0.1:9002"]}],
    "discovery": {"stale_after_seconds": 1.0},
}
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def _body(payload: bytes, key: str | None = KEY, path: str = "/v1/completions",
          authorization: str | None = None) -> ep.ProcessingRequest:
    """A completion request as Envoy sends it: the buffered body with the request attributes."""
    if authorization is None and key is not None:
        authorization = f"Bearer {key}"
    return body_request(payload, path=path, request_id="c-1", authorization=authorization)


def _headers(*pairs: tuple[str, str]) -> ep.ProcessingRequest:
    return headers_request(raw_headers(*pairs))


def _error(resp: ep.ProcessingResponse) -> tuple[int, str]:
    assert resp.WhichOneof("response") == "immediate_response", resp
    imm = resp.immediate_response
    assert {h.header.key: h.header.raw_value for h in imm.headers.set_headers}["content-type"] == b"application/json"
    err = json.loads(imm.body)["error"]
    assert err["message"] and err["param"] is None, err
    assert err["type"] == {429: "rate_limit_error", 503: "server_error"}.get(imm.status.code, "invalid_request_error")
    return imm.status.code, err["code"]


async def _end_ok(call: grpc.aio.StreamStreamCall) -> None:
    """End a stream from the client side, as Envoy does when the HTTP stream ends; the server ends it cleanly."""
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK


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
            rid = meta["modeldock"].pop("rid")
            assert rid and rid != "c-1"  # ext_proc's own key, not the client's x-request-id
            assert meta["modeldock"] == {"cluster": "model:m", "model": "m", "tenant": "t"}
            endpoints = meta["envoy.lb"]["x-gateway-destination-endpoint"].split(",")
            assert sorted(endpoints) == ["127.0.0.1:9001", "127.0.0.1:9002"]
            assert ext.picker.in_flight(Endpoint.parse(endpoints[0])) == ext.picker.total_in_flight() == 1
            # Envoy's access log reports a retry on the other endpoint: the count follows it.
            # A report for a request this replica does not hold changes nothing.
            retries = ext.metrics.retries._value.get()
            log = als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs()
            await log.write(retry_report(("someone-else", endpoints[0])))
            await log.write(retry_report(("c-1", endpoints[0])))  # the client's id keys nothing
            await log.write(retry_report((rid, endpoints[1])))
            other = Endpoint.parse(endpoints[1])
            await _wait(lambda other=other: ext.picker.in_flight(other) == 1)
            assert ext.picker.total_in_flight() == 1
            assert ext.metrics.retries._value.get() == retries + 1
            await log.done_writing()
            assert isinstance(await log, als_pb2.StreamAccessLogsResponse)
            if cancel:
                call.cancel()
            else:
                await _end_ok(call)
            await _wait(lambda: ext.picker.total_in_flight() == 0)
            # A report that comes after the stream ended counts nothing.
            late = als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs()
            await late.write(retry_report((rid, endpoints[0])))
            await late.done_writing()
            await late
            assert ext.picker.total_in_flight() == 0 and ext.metrics.retries._value.get() == retries + 1


async def test_requests_that_are_not_completions(servers) -> None:
    """The model list (the one route whose headers are sent), rejected bodies, and messages out of order
    (anything but a body or the model list's headers first): each a JSON answer, on a fresh stream each."""
    _, ext, _ = servers
    cases: list[tuple[ep.ProcessingRequest, tuple[int, str] | None]] = [
        (_headers((":method", "GET"), (":path", "/v1/models"), ("authorization", f"Bearer {KEY}")), None),
        (_headers((":method", "GET"), (":path", "/v1/models")), (401, "missing_api_key")),
        (ep.ProcessingRequest(response_headers=ep.HttpHeaders()), (400, "invalid_request")),
        (ep.ProcessingRequest(request_trailers=ep.HttpTrailers()), (400, "invalid_request")),
        (_body(b'{"model":"m"}', path="/v1/embeddings"), (404, "unknown_url")),
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
            await _end_ok(call)
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
        await _end_ok(call)
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
        ext.gateway.check_dispatchable("m")
    assert getattr(info.value, "code", "") == "endpoint_snapshot_stale"


async def test_stop_does_not_wait_out_the_grace_for_envoys_log_streams(tmp_path: Path) -> None:
    """Envoy never ends its access-log streams; once no ext_proc stream is open, stopping ends them."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(DATA))
    config = parse_config(DATA)
    xds = XdsServer(config, XdsOptions(path, port=0, tick_seconds=0.05))
    await xds.start()
    ext = ExtProcServer(config, ExtProcOptions(f"127.0.0.1:{xds.bound_port}", port=0))
    await ext.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ext.bound_port}") as channel:
            log = als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs()
            await log.write(retry_report(("nobody", "127.0.0.1:9001")))
            await _wait(lambda: ext.attempts.open_streams == 1)
            # A grace far longer than the wait: the stop must not sit it out.
            await asyncio.wait_for(ext.stop(60), 10)
            assert isinstance(await log, als_pb2.StreamAccessLogsResponse)  # ended by the server, cleanly
    finally:
        await xds.stop(0.1)
