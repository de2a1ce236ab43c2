"""grpc.aio glue for ADS: one stream state machine per connection, fed by requests and cache changes.

State of the world (`SotwStream`) and delta (`DeltaStream`) share the same loop:
one reader task puts requests on a queue, the cache listener puts change marks
on it, and the handler answers them in order, so the state machine never runs
concurrently with itself.

A servicer created with `serving=False` accepts streams but holds them, without
reading or answering, until `start_serving`: the xDS server listens from the
start, while it waits for discovery's first list. A client that reconnects in
that time keeps its stream instead of failing and backing off further (Envoy's
reconnect backoff grows to 30 s), so it is answered as soon as the state is
known.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2

from modeldock.xds.cache import ResourceCache
from modeldock.xds.delta import DeltaStream
from modeldock.xds.protocol import SotwStream, StreamEvents

log = logging.getLogger("modeldock.xds")

_CHANGED = object()
_END = object()


class _Stream(Protocol):
    peer: str
    node_id: str

    def on_request(self, request: Any) -> list[Any]: ...

    def on_change(self) -> list[Any]: ...


# The generated servicer base is untyped (xds-protos ships no stubs).
class AdsServicer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):  # type: ignore[misc]
    def __init__(self, cache: ResourceCache, events: StreamEvents | None = None, *, serving: bool = True) -> None:
        self._cache = cache
        self._events = events or StreamEvents()
        self.streams = 0  # streams being served; held ones are not counted
        self._queues: set[asyncio.Queue[object]] = set()
        self._serving = asyncio.Event()
        if serving:
            self._serving.set()
        self._closing = False

    def start_serving(self) -> None:
        """Answer streams from now on, held ones included (the cache holds the full state)."""
        self._serving.set()

    def close_streams(self) -> None:
        """End every open stream cleanly (on shutdown); clients reconnect elsewhere or later."""
        self._closing = True
        self._serving.set()  # held streams end without an answer
        for queue in self._queues:
            queue.put_nowait(_END)

    async def StreamAggregatedResources(  # noqa: N802 (gRPC name)
        self,
        request_iterator: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        stream = SotwStream(self._cache, peer=context.peer(), events=self._events)
        async for response in self._serve(stream, request_iterator, "ADS"):
            yield response

    async def DeltaAggregatedResources(  # noqa: N802 (gRPC name)
        self,
        request_iterator: AsyncIterator[discovery_pb2.DeltaDiscoveryRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[discovery_pb2.DeltaDiscoveryResponse]:
        stream = DeltaStream(self._cache, peer=context.peer(), events=self._events)
        async for response in self._serve(stream, request_iterator, "delta ADS"):
            yield response

    async def _serve(self, stream: _Stream, request_iterator: AsyncIterator[Any], kind: str) -> AsyncIterator[Any]:
        # Requests wait unread in the transport meanwhile: the first is answered from the full state.
        await self._serving.wait()
        if self._closing:
            return
        queue: asyncio.Queue[object] = asyncio.Queue()

        def changed() -> None:
            queue.put_nowait(_CHANGED)

        async def read() -> None:
            try:
                async for request in request_iterator:
                    queue.put_nowait(request)
            except (asyncio.CancelledError, grpc.aio.AioRpcError):
                pass
            finally:
                queue.put_nowait(_END)

        self._cache.add_listener(changed)
        self._queues.add(queue)
        reader = asyncio.create_task(read())
        self.streams += 1
        self._events_connected(+1)
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    break
                if item is _CHANGED:
                    # Coalesce a burst of changes into one pass.
                    while not queue.empty() and queue._queue[0] is _CHANGED:  # type: ignore[attr-defined]
                        queue.get_nowait()
                    responses = stream.on_change()
                else:
                    responses = stream.on_request(item)
                for response in responses:
                    yield response
        finally:
            self.streams -= 1
            self._events_connected(-1)
            self._cache.remove_listener(changed)
            self._queues.discard(queue)
            reader.cancel()
            log.info("%s stream from %s closed", kind, stream.node_id or stream.peer)

    def _events_connected(self, delta: int) -> None:
        hook = getattr(self._events, "connected", None)
        if hook is not None:
            hook(delta)
