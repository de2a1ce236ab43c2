"""grpc.aio glue for picker mode: one PickerFlow per ext_proc stream, finished when the stream ends."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from modeldock.epp.flow import PickerFlow, PickerOptions
from modeldock.gateway import Gateway
from modeldock.gateway.lifecycle import Lifecycle

log = logging.getLogger("modeldock.epp")

_DEFAULT_OPTIONS = PickerOptions()  # frozen: one shared default is safe


# The generated servicer base is untyped (xds-protos ships no stubs).
class PickerServicer(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """`lifecycle` (made by the app with its hooks; default: one without) keys, settles and reports each
    stream's request; it must settle at each stream end (`await_reports=False`): no usage log comes."""

    def __init__(self, gateway: Gateway, options: PickerOptions = _DEFAULT_OPTIONS,
                 lifecycle: Lifecycle | None = None) -> None:
        self._gateway = gateway
        self._options = options
        self.lifecycle = Lifecycle(gateway, await_reports=False) if lifecycle is None else lifecycle
        self.open_streams = 0

    async def Process(  # noqa: N802 (gRPC name)
        self, _requests: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        flow = PickerFlow(self._gateway, self._options, lifecycle=self.lifecycle)
        self.open_streams += 1
        try:
            while True:
                request = await context.read()
                if request is grpc.aio.EOF:
                    break
                for response in await flow.handle(request):
                    await context.write(response)
        except Exception:
            log.exception("ext_proc stream failed")  # the finally still releases
        finally:
            # The gateway ends the stream with the HTTP stream (every phase is sent), a client
            # disconnect included (the handler is then cancelled).
            self.open_streams -= 1
            flow.finish()  # releases, settles and reports it (the lifecycle's hooks)
