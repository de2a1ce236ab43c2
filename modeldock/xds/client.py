"""An ADS client: how ext_proc learns endpoints from the xDS server.

ext_proc subscribes to the same ClusterLoadAssignments Envoy gets, plus the
status resource, so Envoy and ext_proc share one source of truth. While the
xDS server is unreachable the last state is kept; `disconnected_for` lets the
caller stop dispatching once that has lasted past the staleness cutoff.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import struct_pb2

from modeldock.clock import Clock
from modeldock.types import Endpoint, model_of_cluster
from modeldock.xds.resources import (
    ENDPOINT_TYPE,
    STATUS_NAME,
    STATUS_TYPE,
    endpoints_of,
    stale_models_of,
)

log = logging.getLogger("modeldock.xds.client")


class AdsClient:
    def __init__(
        self,
        target: str,
        cluster_names: Iterable[str],
        *,
        node_id: str,
        clock: Clock,
        on_endpoints: Callable[[str, tuple[Endpoint, ...]], None],
        on_status: Callable[[frozenset[str]], None],
        retry_max: float = 2.0,
    ) -> None:
        self._target = target
        self._clusters = sorted(cluster_names)
        self._node = base_pb2.Node(id=node_id, cluster="modeldock-extproc")
        self._clock = clock
        self._on_endpoints = on_endpoints
        self._on_status = on_status
        self._retry_max = retry_max
        self._down_since: float | None = clock.monotonic()
        self.synced = asyncio.Event()  # set once the server's status has arrived on a stream

    def disconnected_for(self) -> float:
        """Seconds without a working stream; 0 while connected."""
        if self._down_since is None:
            return 0.0
        return self._clock.monotonic() - self._down_since

    async def run(self) -> None:
        delay = 0.1
        while True:
            try:
                await self._stream_once()
                delay = 0.1
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                log.warning("xDS stream to %s failed: %s; retrying", self._target, exc.code().name)
            except Exception:  # keep serving the last state; never crash ext_proc
                log.exception("xDS client error; retrying")
            if self._down_since is None:
                self._down_since = self._clock.monotonic()
            await asyncio.sleep(delay)
            delay = min(self._retry_max, delay * 2)

    async def _stream_once(self) -> None:
        outgoing: asyncio.Queue[discovery_pb2.DiscoveryRequest | None] = asyncio.Queue()

        async def requests() -> AsyncIterator[discovery_pb2.DiscoveryRequest]:
            while True:
                item = await outgoing.get()
                if item is None:
                    return
                yield item

        outgoing.put_nowait(discovery_pb2.DiscoveryRequest(
            node=self._node, type_url=ENDPOINT_TYPE, resource_names=self._clusters))
        outgoing.put_nowait(discovery_pb2.DiscoveryRequest(
            node=self._node, type_url=STATUS_TYPE, resource_names=[STATUS_NAME]))
        seen: set[str] = set()
        accepted: dict[str, str] = {}  # type -> last version applied, echoed in NACKs
        async with grpc.aio.insecure_channel(self._target) as channel:
            stub = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel)
            call = stub.StreamAggregatedResources(requests())
            try:
                async for response in call:
                    names = self._clusters if response.type_url == ENDPOINT_TYPE else [STATUS_NAME]
                    ack = discovery_pb2.DiscoveryRequest(
                        node=self._node, type_url=response.type_url, version_info=response.version_info,
                        response_nonce=response.nonce, resource_names=names)
                    try:
                        self._apply(response)
                    except Exception as exc:  # a NACK keeps the last good state
                        log.error("rejecting xDS %s version %s: %s", response.type_url, response.version_info, exc)
                        ack.version_info = accepted.get(response.type_url, "")
                        ack.error_detail.message = str(exc)[:500]
                    else:
                        accepted[response.type_url] = response.version_info
                    outgoing.put_nowait(ack)
                    seen.add(response.type_url)
                    # The status resource is the server vouching for every model (stale or
                    # not); assignments it has not sent yet are kept from before.
                    if STATUS_TYPE in seen and self._down_since is not None:
                        self._down_since = None
                        self.synced.set()
                        log.info("xDS stream to %s in sync", self._target)
            finally:
                outgoing.put_nowait(None)
                call.cancel()

    def _apply(self, response: discovery_pb2.DiscoveryResponse) -> None:
        if response.type_url == ENDPOINT_TYPE:
            parsed: list[tuple[str, tuple[Endpoint, ...]]] = []
            for packed in response.resources:
                assignment = endpoint_pb2.ClusterLoadAssignment()
                if not packed.Unpack(assignment):
                    raise ValueError(f"resource of type {packed.type_url} in an EDS response")
                model = model_of_cluster(assignment.cluster_name)
                if model is not None:
                    parsed.append((model, endpoints_of(assignment)))
            for model, endpoints in parsed:
                self._on_endpoints(model, endpoints)
        elif response.type_url == STATUS_TYPE:
            for packed in response.resources:
                status = struct_pb2.Struct()
                if not packed.Unpack(status):
                    raise ValueError("status resource is not a Struct")
                self._on_status(stale_models_of(status))
