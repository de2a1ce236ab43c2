"""grpc.aio glue for ext_proc: one RequestFlow per stream, finished when the stream ends."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from modeldock.extproc.flow import RequestFlow
from modeldock.gateway import Gateway
from modeldock.gateway.lifecycle import Lifecycle

log = logging.getLogger("modeldock.extproc")


# The generated servicer base is untyped (xds-protos ships no stubs).
class ExtProcServicer(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """`lifecycle` (made by the app with its hooks; default: one without) keys each stream's request,
    holds it once routed for Envoy's retry and usage reports, and settles it (gateway/lifecycle.py)."""

    def __init__(self, gateway: Gateway, lifecycle: Lifecycle | None = None) -> None:
        self._gateway = gateway
        self.lifecycle = Lifecycle(gateway) if lifecycle is None else lifecycle
        self.open_streams = 0

    async def Process(  # noqa: N802 (gRPC name)
        self,
        _requests: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        # context.read()/write() rather than an async generator: one fewer
        # coroutine hop per message (benchmarks/extproc_cost.py).
        flow = RequestFlow(self._gateway, lifecycle=self.lifecycle)
        self.open_streams += 1
        try:
            while True:
                request = await context.read()
                if request is grpc.aio.EOF:
                    break
                await context.write(await flow.handle(request))
        except Exception:
            # A broken stream must not leak: the finally below still releases.
            log.exception("ext_proc stream failed")
        finally:
            # Envoy ends the stream when the HTTP stream ends, including client
            # disconnects (the handler is then cancelled).
            self.open_streams -= 1
            flow.finish()  # releases, then the lifecycle settles (or awaits the report) and reports it
