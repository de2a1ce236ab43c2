"""How a backend's token usage reaches the gateway without the body passing through Python.

Pins the Envoy 1.40 behaviour docs/envoy.md ("Usage from responses") relies on, with the real
binary, the real simulator and the openai SDK as the client:

- `json_to_metadata` response rules copy `usage.*` from a JSON body into dynamic metadata, but
  only with `allow_content_types` listing `application/json; charset=utf-8` (vLLM's and the
  simulator's header); the default list does not match it;
- `sse_to_metadata` (JSON content parser) copies `usage.*` from the final SSE chunk;
- both land in the gRPC access log entry (`common_properties.metadata`) the ext_proc already
  hears, a few ms after the response ends (with the gateway's buffering, `USAGE_LOG_BUFFER`:
  entries of requests ending within its flush interval share one message); a stream without
  usage, or one the client cut, has no usage there;
- a Lua response filter (the bootstrap's own script) drops the usage chunk the client did not ask
  for, after `sse_to_metadata` has read it (split usage events: tests/e2e/test_usage_split_events.py).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from envoy.data.accesslog.v3 import accesslog_pb2
from google.protobuf import json_format

from modeldock.envoy import USAGE_LOG_BUFFER, BootstrapOptions, envoy_binary, render_bootstrap
from modeldock.up import Supervisor, free_port
from tests.support.access_log import AccessLogCollector
from tests.support.stack import Sim, start_sims, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
NS = "modeldock.usage"
MODEL = "m"


def usage_rule(key: str, namespace: str = NS) -> dict[str, Any]:
    return {"selectors": [{"key": "usage"}, {"key": key}],
            "on_present": {"metadata_namespace": namespace, "key": key, "type": "NUMBER"}}


USAGE_KEYS = ("prompt_tokens", "completion_tokens")

def _bootstrap_lua() -> str:
    """The drop-usage Lua filter exactly as envoy/bootstrap.yaml has it (one copy of the script)."""
    config = yaml.safe_load(render_bootstrap(BootstrapOptions(listen_port=1, admin_port=2, xds_port=3,
                                                              extproc_port=4)))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (lua,) = [f for f in hcm["http_filters"] if f["name"] == "modeldock.drop_usage_chunk"]
    typed = lua["typed_config"].get("extension_config", {}).get("typed_config", lua["typed_config"])  # the gate
    source: str = typed["default_source_code"]["inline_string"]
    return source


DROP_USAGE_LUA = _bootstrap_lua()

# The filters docs/envoy.md recommends, in HCM order (responses pass them bottom-up:
# router -> sse_to_metadata -> json_to_metadata -> lua, so the SSE filter reads the usage
# chunk before Lua drops it).
USAGE_FILTERS: list[dict[str, Any]] = [
    {"name": "envoy.filters.http.lua", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": DROP_USAGE_LUA}}},
    {"name": "envoy.filters.http.json_to_metadata", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata",
        "response_rules": {"allow_content_types": ["application/json", "application/json; charset=utf-8"],
                           "rules": [usage_rule(k) for k in USAGE_KEYS]}}},
    {"name": "envoy.filters.http.sse_to_metadata", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.sse_to_metadata.v3.SseToMetadata",
        "response_rules": {"content_parser": {"name": "envoy.content_parsers.json", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.content_parsers.json.v3.JsonContentParser",
            "rules": [{"rule": usage_rule(k)} for k in USAGE_KEYS]}}}}},
]

# Test scaffolding, not part of the recommendation: ext_proc would set modeldock:drop_usage
# itself; here a header stands in for it. And a json_to_metadata filter with the default
# content types, to pin that it does not match `application/json; charset=utf-8`.
SCAFFOLDING: list[dict[str, Any]] = [
    {"name": "envoy.filters.http.header_to_metadata", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
        "request_rules": [{"header": "x-test-drop-usage", "on_header_present": {
            "metadata_namespace": "modeldock", "key": "drop_usage", "type": "STRING"}, "remove": True}]}},
    {"name": "envoy.filters.http.json_to_metadata", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata",
        "response_rules": {"rules": [usage_rule("prompt_tokens", "test.default_types")]}}},
]


def bootstrap(listen: int, admin: int, als: int, sim: int) -> dict[str, Any]:
    def cluster(name: str, port: int, h2: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"name": name, "type": "STATIC", "connect_timeout": "1s", "load_assignment": {
            "cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}
        if h2:
            out["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}}
        return out

    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                 ".HttpConnectionManager",
        "stat_prefix": "usage", "preserve_external_request_id": True,
        "access_log": [{"name": "envoy.access_loggers.http_grpc", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {"log_name": "usage", "transport_api_version": "V3",
                              "grpc_service": {"envoy_grpc": {"cluster_name": "als"}},
                              **USAGE_LOG_BUFFER}}}],
        "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
            {"match": {"prefix": "/dead/"}, "route": {"cluster": "dead", "prefix_rewrite": "/"}},
            {"match": {"prefix": "/"}, "route": {"cluster": "sim", "timeout": "0s"}}]}]},
        "http_filters": [*SCAFFOLDING, *USAGE_FILTERS, {"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [{"name": "l", "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                           "typed_config": hcm}]}]}],
            "clusters": [cluster("sim", sim), cluster("als", als, h2=True), cluster("dead", free_port())],
        },
    }


@dataclass
class Rig:
    client: openai.AsyncOpenAI
    dead: openai.AsyncOpenAI  # routes to a port nobody listens on
    logs: AccessLogCollector
    sim: Sim

    async def entry(self, request_id: str) -> tuple[accesslog_pb2.HTTPAccessLogEntry, float]:
        heard = await self.logs.wait_for(lambda e: e.request.request_id == request_id)
        return heard.entry, heard.at


def metadata(entry: accesslog_pb2.HTTPAccessLogEntry, namespace: str = NS) -> dict[str, Any] | None:
    found = entry.common_properties.metadata.filter_metadata
    return json_format.MessageToDict(found[namespace]) if namespace in found else None


@pytest.fixture
async def rig(tmp_path: Path, access_log: tuple[AccessLogCollector, int]) -> AsyncIterator[Rig]:
    logs, als_port = access_log
    sup = Supervisor(tmp_path)
    try:
        (sim,) = start_sims(sup, 1, ("--speed", "20"), model=MODEL)
        listen, admin = free_port(), free_port()
        path = tmp_path / "envoy.yaml"
        path.write_text(json.dumps(bootstrap(listen, admin, als_port, sim.port)))  # JSON is YAML
        sup.start("envoy", [envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1",
                            "-l", "warning"])

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=1) as resp:  # noqa: S310
                    return bool(resp.status == 200)
            except OSError:
                return False

        wait_until(ready, 20, what="Envoy ready")
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{listen}/v1", api_key="unused", max_retries=0)
        dead = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{listen}/dead/v1", api_key="unused", max_retries=0)
        try:
            yield Rig(client, dead, logs, sim)
        finally:
            await client.close()
            await dead.close()
    finally:
        sup.stop_all(timeout=5)


def rid() -> str:
    return str(uuid.uuid4())


async def test_json_body_usage_reaches_the_access_log(rig: Rig) -> None:
    request_id = rid()
    reply = await rig.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=5,
        extra_headers={"x-request-id": request_id})
    assert reply.usage is not None
    entry, _ = await rig.entry(request_id)
    assert metadata(entry) == {"prompt_tokens": reply.usage.prompt_tokens,
                               "completion_tokens": reply.usage.completion_tokens}
    # The default allow_content_types ("application/json" only) misses the charset variant.
    assert metadata(entry, "test.default_types") is None


async def test_final_sse_chunk_usage_reaches_the_access_log_after_the_stream_ends(rig: Rig) -> None:
    request_id = rid()
    stream = await rig.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_headers={"x-request-id": request_id})
    chunks = [chunk async for chunk in stream]
    ended = time.monotonic()
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    entry, at = await rig.entry(request_id)
    assert metadata(entry) == {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}
    # Measured 1-10 ms unbuffered, up to the 20 ms flush interval buffered; the bound leaves room
    # for a loaded machine.
    assert at - ended < 1.0


async def test_entries_of_requests_ending_together_share_one_message(rig: Rig) -> None:
    ids = [rid() for _ in range(8)]

    async def ask(request_id: str) -> float:
        await rig.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=2,
            extra_headers={"x-request-id": request_id})
        return time.monotonic()

    ended = await asyncio.gather(*(ask(i) for i in ids))
    heard = [await rig.logs.wait_for(lambda e, i=i: e.request.request_id == i) for i in ids]  # type: ignore[misc]
    assert len({h.message for h in heard}) < len(ids)  # batched: fewer messages than entries
    assert all(h.at - end < 1.0 for h, end in zip(heard, ended, strict=True))  # each still within the flush


async def test_lua_drops_the_usage_chunk_the_client_did_not_ask_for(rig: Rig) -> None:
    request_id = rid()
    # What ext_proc would do: ask the backend for usage, and mark the request so Lua drops it.
    stream = await rig.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-request-id": request_id, "x-test-drop-usage": "1"})
    chunks = [chunk async for chunk in stream]
    assert chunks and all(chunk.usage is None and chunk.choices for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    entry, _ = await rig.entry(request_id)
    usage = metadata(entry)
    assert usage is not None and usage["completion_tokens"] == 8  # read before Lua dropped the chunk


async def test_no_usage_when_the_stream_has_none(rig: Rig) -> None:
    request_id = rid()
    stream = await rig.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4, stream=True,
        extra_headers={"x-request-id": request_id})
    chunks = [chunk async for chunk in stream]
    assert chunks and all(chunk.usage is None for chunk in chunks)
    entry, _ = await rig.entry(request_id)
    assert entry.response.response_code.value == 200 and entry.response.upstream_header_bytes_received > 0
    assert metadata(entry) is None


async def test_a_stream_the_client_cuts_has_no_usage(rig: Rig) -> None:
    request_id = rid()
    stream = await rig.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2000, stream=True,
        stream_options={"include_usage": True}, extra_headers={"x-request-id": request_id})
    seen = 0
    async for _chunk in stream:
        seen += 1
        if seen == 3:
            break
    await stream.close()
    entry, _ = await rig.entry(request_id)
    assert metadata(entry) is None
    assert entry.common_properties.response_flags.downstream_connection_termination
    assert entry.response.upstream_header_bytes_received > 0  # it reached a backend: charge the reservation


async def test_a_request_no_backend_answered_has_no_upstream_header_bytes(rig: Rig) -> None:
    request_id = rid()
    with pytest.raises(openai.InternalServerError):
        await rig.dead.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4,
            extra_headers={"x-request-id": request_id})
    entry, _ = await rig.entry(request_id)
    assert entry.response.response_code.value == 503
    assert entry.response.upstream_header_bytes_received == 0  # never reached a backend: refund
    assert metadata(entry) is None
