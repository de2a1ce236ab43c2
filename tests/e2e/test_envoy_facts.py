"""Envoy 1.40 behaviour that modeldock's one-message ext_proc design relies on.

Each test runs the real bootstrap (`render_bootstrap`) with the ADS parts swapped for a
static cluster, a scripted ext_proc servicer and a recording upstream, so a change in
Envoy (or in envoy/bootstrap.yaml) that breaks one of these facts fails here, by name,
before it shows up as a confusing end-to-end failure. See docs/envoy.md.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import message

from modeldock import replies
from modeldock.envoy import BootstrapOptions, render_bootstrap
from modeldock.errors import Unauthorized
from modeldock.extproc import responses
from modeldock.extproc.wire import parse_request
from modeldock.types import cluster_name
from tests.support.access_log import access_log_server
from tests.support.envoy_rig import ATTRS, BODY, Rig, envoy_rig, route

pytestmark = pytest.mark.e2e


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with envoy_rig(tmp_path) as running:
        yield running


async def test_router_waits_for_the_body_answer(rig: Rig) -> None:
    # With the header phase skipped, only the buffer filter keeps the router from
    # starting the upstream request before ext_proc has picked.
    rig.extproc.body_delay = 0.3
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    r = await rig.post()
    assert r.status_code == 200 and r.text == "okend"
    (stream,) = rig.extproc.streams
    (got,) = rig.upstream.received
    assert got.at >= stream.answered_at[0]


async def test_metadata_picks_cluster_and_endpoint(rig: Rig) -> None:
    for port in (rig.ports[1], rig.ports[0], rig.ports[1]):
        rig.extproc.answer = route(f"127.0.0.1:{port}")
        assert (await rig.post()).status_code == 200
        assert rig.upstream.received[-1].port == port
    # The routing headers never reach the upstream, whatever the client sent.
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    r = await rig.post(headers=[("authorization", "Bearer k"),
                                ("x-gateway-destination-endpoint", f"127.0.0.1:{rig.ports[1]}"),
                                ("x-modeldock-cluster", "modeldock_extproc")])
    assert r.status_code == 200
    got = rig.upstream.received[-1]
    assert got.port == rig.ports[0]
    assert not {"authorization", "x-gateway-destination-endpoint", "x-modeldock-cluster"} & set(got.headers)


async def test_route_cache_is_cleared_only_with_a_header_mutation(rig: Rig) -> None:
    def without_mutation(_r: ep.ProcessingRequest) -> ep.ProcessingResponse:
        resp = responses.route_request_body(cluster_name("m"), f"127.0.0.1:{rig.ports[0]}")
        resp.request_body.response.ClearField("header_mutation")
        return resp

    rig.extproc.answer = without_mutation
    r = await rig.post()
    # The route matched before the metadata existed stays: the catch-all reply, never upstream.
    assert r.status_code == 503 and r.error()["code"] == "upstream_unavailable" and not rig.upstream.received
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    assert (await rig.post()).status_code == 200


async def test_body_answer_header_mutations_are_ignored(rig: Rig) -> None:
    def set_header(_r: ep.ProcessingRequest) -> ep.ProcessingResponse:
        resp = responses.route_request_body(cluster_name("m"), f"127.0.0.1:{rig.ports[0]}")
        resp.request_body.response.header_mutation.set_headers.add(
            header=base_pb2.HeaderValue(key="x-from-extproc", raw_value=b"1"))
        return resp

    rig.extproc.answer = set_header
    assert (await rig.post()).status_code == 200
    assert "x-from-extproc" not in rig.upstream.received[-1].headers


async def test_attributes_ride_on_the_only_message(rig: Rig) -> None:
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    r = await rig.post(headers=[("authorization", "Bearer a"), ("authorization", "Bearer b")],
                       path="/v1/chat/completions?x=1")
    assert r.status_code == 200
    (stream,) = rig.extproc.streams
    assert stream.kinds == ["request_body"]  # response headers are skipped
    (body_attrs,) = stream.attributes
    assert body_attrs["request.method"] == "POST"
    assert body_attrs["request.path"] == "/v1/chat/completions?x=1"
    assert body_attrs["request.headers['authorization']"] == "Bearer a,Bearer b"  # joined
    assert body_attrs["request.id"] == rig.upstream.received[-1].headers["x-request-id"]
    # No Authorization header: the attribute is left out.
    await rig.post(headers=[("content-type", "application/json")])
    assert "request.headers['authorization']" not in rig.extproc.streams[-1].attributes[0]


async def test_stream_stays_open_until_the_response_ends(rig: Rig) -> None:
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    assert (await rig.post()).text == "okend"
    await asyncio.sleep(0.1)
    (stream,) = rig.extproc.streams
    assert stream.ended_at >= rig.upstream.finished_at[0]
    assert stream.ended_at - stream.answered_at[-1] >= 0.15  # the 0.2 s reply, not the last answer


@pytest.mark.parametrize(("method", "path", "status", "code"), [
    ("POST", "/v1/chat/completions", 400, "invalid_body"), ("POST", "/v1/completions?x=1", 400, "invalid_body"),
    ("GET", "/v1/chat/completions", 400, "method_not_allowed"), ("DELETE", "/any\"thing", 404, "unknown_url")])
async def test_a_bodiless_request_never_reaches_ext_proc_and_gets_a_json_error(rig: Rig, method: str, path: str,
                                                                            status: int, code: str) -> None:
    r = await rig.post(body=None, method=method, path=path, headers=[
        ("authorization", "Bearer k"), ("x-modeldock-cluster", cluster_name("m")),
        ("x-gateway-destination-endpoint", f"127.0.0.1:{rig.ports[0]}")])
    assert (r.status_code, r.error()["code"]) == (status, code)
    assert not rig.upstream.received and not rig.extproc.streams
    if code != "invalid_body":
        assert path in r.error()["message"]  # escaped by Envoy's JSON formatter


async def test_envoys_reply_after_every_endpoint_failed_is_a_json_503(rig: Rig) -> None:
    rig.upstream.close()  # nothing listens on either endpoint any more
    await asyncio.sleep(0.05)
    rig.extproc.answer = route(",".join(f"127.0.0.1:{p}" for p in rig.ports))
    r = await rig.post()
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    err = r.error()
    assert err["code"] == "upstream_unavailable" and err["type"] == "server_error"
    # Envoy's details go to the access log, not to the client.
    assert err["message"] == "No endpoint of model `m` could take the request. Retry shortly."
    assert rig.extproc.streams[0].kinds == ["request_body"]
    (line,) = await rig.access_log()
    assert "UF" in line.partition("flags=")[2].split()[0]
    assert "details=upstream_reset_before_response_started{" in line
    assert "connection_refused" in line.partition("failure=")[2].lower()


async def test_ext_procs_own_replies_pass_unchanged(rig: Rig) -> None:
    rig.extproc.answer = lambda _r: replies.rejection_response(Unauthorized("no such key"))
    r = await rig.post()
    assert r.status_code == 401
    assert r.error() == Unauthorized("no such key").body()["error"]


async def test_ext_proc_failing_is_a_json_503(rig: Rig) -> None:
    def fail(_r: ep.ProcessingRequest) -> ep.ProcessingResponse:
        raise RuntimeError("broken")

    rig.extproc.answer = fail
    r = await rig.post()
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.error()["code"] == "gateway_unavailable" and not rig.upstream.received


async def test_a_retry_is_reported_by_the_upstream_access_log(rig: Rig) -> None:
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[1]},127.0.0.1:{rig.ports[0]}", rid="rid-first")
    assert (await rig.post()).status_code == 200
    await asyncio.sleep(0.1)
    assert rig.retries == []  # first attempts are not logged
    rig.upstream.servers[0].close()  # never connected to: the primary below refuses, Envoy retries
    await asyncio.sleep(0.05)
    rig.extproc.answer = route(",".join(f"127.0.0.1:{p}" for p in rig.ports), rid="rid-2")
    assert (await rig.post(headers=[("authorization", "Bearer k"), ("x-request-id", "client-id")])).status_code == 200
    got = rig.upstream.received[-1]
    assert got.port == rig.ports[1] and got.headers["x-envoy-attempt-count"] == "2"
    for _ in range(100):
        if rig.retries:
            break
        await asyncio.sleep(0.01)
    # The entry names the request by ext_proc's key (modeldock:rid through the logged x-modeldock-rid header;
    # an upstream log entry carries no dynamic metadata), not by the client's x-request-id.
    assert rig.retries == [("rid-2", f"127.0.0.1:{rig.ports[1]}")]
    assert got.headers["x-request-id"] == "client-id" and got.headers["x-modeldock-rid"] == "rid-2"


async def test_the_rid_header_is_set_only_from_metadata(rig: Rig) -> None:
    # A client cannot set it (the first filter drops x-modeldock-*), and no metadata adds no header.
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    r = await rig.post(headers=[("authorization", "Bearer k"), ("x-modeldock-rid", "forged")])
    assert r.status_code == 200 and "x-modeldock-rid" not in rig.upstream.received[-1].headers
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}", rid="rid-3", tenant="acme")
    r = await rig.post(headers=[("authorization", "Bearer k"), ("x-modeldock-rid", "forged")])
    assert r.status_code == 200 and rig.upstream.received[-1].headers["x-modeldock-rid"] == "rid-3"
    assert "tenant=acme " in (await rig.access_log(2))[-1]
    assert "x-modeldock-rid" not in r.headers


async def test_ratelimit_headers_come_from_the_route_metadata(rig: Rig) -> None:
    limits = {"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
              "x-ratelimit-reset-requests": "1s"}
    rig.extproc.answer = lambda _r: responses.route_request_body(cluster_name("m"), f"127.0.0.1:{rig.ports[0]}",
                                                                 model="m", response_headers=limits)
    r = await rig.post()
    assert r.status_code == 200 and {k: r.headers[k] for k in limits} == limits
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    r = await rig.post()
    assert r.status_code == 200 and not [k for k in r.headers if k.startswith("x-ratelimit")]


async def test_content_length_follows_a_rewritten_body(rig: Rig) -> None:
    new = b'{"model":"a-much-longer-upstream-name","messages":[]}'
    rig.extproc.answer = lambda _r: responses.route_request_body(cluster_name("m"), f"127.0.0.1:{rig.ports[0]}", new)
    assert (await rig.post()).status_code == 200
    got = rig.upstream.received[-1]
    assert got.body == new and got.headers["content-length"] == str(len(new))
    # Not rewritten: the client's length stands.
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    await rig.post()
    assert rig.upstream.received[-1].headers["content-length"] == str(len(BODY))


async def test_models_route_sends_request_headers(rig: Rig) -> None:
    r = await rig.post(body=None, method="GET", path="/v1/models",
                       headers=[("authorization", "Bearer k"), ("x-other", "1"), ("x-request-id", "r-1")])
    # The scripted servicer answers headers with "continue", so the route's own reply follows: the
    # real ext_proc answers the model list itself, so that reply means ext_proc was passed by.
    assert (r.status_code, r.error()["code"]) == (503, "gateway_unavailable")
    (stream,) = rig.extproc.streams
    assert stream.kinds == ["request_headers"]
    # forward_rules: only the headers ext_proc reads are copied into the message.
    assert sorted(stream.header_names[0]) == [":method", ":path", "authorization", "x-request-id"]


async def test_a_body_over_the_buffer_limit_is_refused_by_envoy(rig: Rig) -> None:
    r = await rig.post(body=b"x" * 5000)
    assert r.status_code == 413 and r.error()["code"] == "request_too_large" and "4096" in r.error()["message"]
    assert not rig.upstream.received and not rig.extproc.streams


async def test_header_bytes_that_are_not_utf8_reach_ext_proc_as_is(rig: Rig) -> None:
    rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}")
    await rig.post(headers=[("authorization", b"Bearer \xff\xfe")])
    raw = rig.extproc.streams[0].raw[0]
    # upb refuses the message; modeldock's decoder keeps it, with the bytes replaced.
    with pytest.raises(message.DecodeError):
        ep.ProcessingRequest.FromString(raw)
    attrs = parse_request(raw).attributes[ATTRS]
    assert attrs.fields["request.headers['authorization']"].string_value == "Bearer \ufffd\ufffd"


def test_bootstrap_uses_one_catch_all_and_a_metadata_gated_route() -> None:
    """The layout the facts above assume; the rest of the bootstrap is covered end to end."""
    config = yaml.safe_load(render_bootstrap(BootstrapOptions(listen_port=1, admin_port=2, xds_port=3,
                                                              extproc_port=4)))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["modeldock.strip_routing_headers", "envoy.filters.http.ext_proc", "envoy.filters.http.buffer",
                     "modeldock.route_from_metadata", "modeldock.forget_upstream_auth", "modeldock.drop_usage_chunk",
                     "modeldock.usage_from_json", "modeldock.usage_from_sse", "envoy.filters.http.router"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert [("direct_response" in r, "dynamic_metadata" in r["match"]) for r in routes] == [
        (True, False), (False, True), (True, False)]
    assert json.dumps(routes[1]["match"]["dynamic_metadata"]).count("present_match") == 1


def _with_hcm_grpc_access_log(port: int) -> Callable[[dict[str, Any]], None]:
    """An HCM-level gRPC access log to `port` (every entry carries all dynamic metadata)."""
    def edit(config: dict[str, Any]) -> None:
        resources = config["static_resources"]
        resources["clusters"].append({
            "name": "test_als", "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": "test_als", "endpoints": [{"lb_endpoints": [{"endpoint": {
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}})
        hcm = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["access_log"].append({"name": "envoy.access_loggers.http_grpc", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {"log_name": "test", "transport_api_version": "V3",
                              "grpc_service": {"envoy_grpc": {"cluster_name": "test_als"}},
                              "buffer_size_bytes": 0, "buffer_flush_interval": "0.005s"}}})
    return edit


@pytest.mark.parametrize("header, value", [("authorization", "Bearer sk-upstream-1"), ("x-api-key", "sk-raw-2"),
                                           ("api-key", "sk-raw-3")])
async def test_the_upstream_credential_comes_from_metadata_and_leaves_no_trace(tmp_path: Path, header: str,
                                                                               value: str) -> None:
    async with access_log_server() as (collector, als_port):
        async with envoy_rig(tmp_path, edit=_with_hcm_grpc_access_log(als_port)) as rig:
            rig.extproc.answer = lambda _r: responses.route_request_body(
                cluster_name("m"), f"127.0.0.1:{rig.ports[0]}", model="m", rid="r-1",
                upstream_auth=(header, value))
            # The client's own credentials of every kind are gone; the gateway's is set after the removal.
            r = await rig.post(headers=[("authorization", "Bearer client-key"), ("x-api-key", "client-key"),
                                        ("api-key", "client-key"), ("x-request-id", "with-auth")])
            assert (r.status_code, r.text) == (200, "okend")
            got = rig.upstream.received[-1].headers
            assert got[header] == value
            assert not [k for k in got if k in ("authorization", "x-api-key", "api-key") and k != header], got
            assert "client-key" not in json.dumps(got) and value not in json.dumps(r.headers)
            # Without the metadata, no header at all (an empty value is not added).
            rig.extproc.answer = route(f"127.0.0.1:{rig.ports[0]}", rid="r-2")
            r = await rig.post(headers=[("authorization", "Bearer client-key"), ("x-request-id", "without-auth")])
            got = rig.upstream.received[-1].headers
            assert r.status_code == 200 and not [k for k in got if k in ("authorization", "x-api-key", "api-key")]
            # Envoy's gRPC access log carries all dynamic metadata: the credential was blanked after use.
            heard = await collector.wait_for(lambda e: e.request.request_id == "with-auth")
            meta = heard.entry.common_properties.metadata.filter_metadata
            assert meta["modeldock"].fields["rid"].string_value == "r-1"  # the rest of the namespace stays
            assert {k: v.string_value for k, v in meta["modeldock.upstream_auth"].fields.items()} == {
                "authorization": "", "x-api-key": "", "api-key": ""}
            assert value.encode() not in heard.entry.SerializeToString()
            lines = await rig.access_log(2)
            assert value not in rig.log.read_text() and "client-key" not in rig.log.read_text(), lines
