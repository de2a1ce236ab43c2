"""grpc.aio glue for ext_proc: one RequestFlow per stream, finished when the stream ends."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from modeldock.extproc.flow import RequestFlow
from modeldock.gateway import Gateway

log = logging.getLogger("modeldock.extproc")


class ExtProcServicer(ep_grpc.ExternalProcessorServicer):
    def __init__(self, gateway: Gateway, on_finish: Callable[[RequestFlow, float], None] | None = None,
                 on_retry: Callable[[RequestFlow], None] | None = None) -> None:
        self._gateway = gateway
        self._on_finish = on_finish
        self._on_retry = on_retry
        self.open_streams = 0
        # Routed requests by x-request-id, for Envoy's retry reports (attempts.py).
        self._routed: dict[str, RequestFlow] = {}

    def retried(self, request_id: str, address: str) -> None:
        """Envoy retried request `request_id` on `address`; ignored unless this replica routed it."""
        flow = self._routed.get(request_id)
        if flow is None:
            return
        if flow.retried_on(address) and self._on_retry is not None:
            self._on_retry(flow)

    async def Process(  # noqa: N802 (gRPC name)
        self,
        _requests: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        # context.read()/write() rather than an async generator: one fewer
        # coroutine hop per message (benchmarks/extproc_cost.py).
        flow = RequestFlow(self._gateway)
        started = time.perf_counter()
        self.open_streams += 1
        request_id = ""
        try:
            while True:
                request = await context.read()
                if request is grpc.aio.EOF:
                    break
                response = await flow.handle(request)
                if flow.lease is not None and not request_id and flow.head is not None and flow.head.request_id:
                    # Before Envoy has the answer, so that no retry report can come first.
                    request_id = flow.head.request_id
                    self._routed[request_id] = flow
                await context.write(response)
        except Exception:
            # A broken stream must not leak: the finally below still releases.
            log.exception("ext_proc stream failed")
        finally:
            # Envoy ends the stream when the HTTP stream ends, including client
            # disconnects (the handler is then cancelled).
            self.open_streams -= 1
            # Only its own entry: a client-sent x-request-id may repeat another's.
            if request_id and self._routed.get(request_id) is flow:
                del self._routed[request_id]
            flow.finish()
            if self._on_finish is not None:
                self._on_finish(flow, time.perf_counter() - started)
