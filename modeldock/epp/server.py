"""grpc.aio glue for picker mode: one PickerFlow per ext_proc stream, finished when the stream ends."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from modeldock.epp.flow import PickerFlow, PickerOptions, RequestKeys
from modeldock.gateway import Gateway

log = logging.getLogger("modeldock.epp")

_DEFAULT_OPTIONS = PickerOptions()  # frozen: one shared default is safe


# The generated servicer base is untyped (xds-protos ships no stubs).
class PickerServicer(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, gateway: Gateway, options: PickerOptions = _DEFAULT_OPTIONS,
                 on_finish: Callable[[PickerFlow, float], None] | None = None,
                 on_retry: Callable[[], None] | None = None) -> None:
        self._gateway = gateway
        self._options = options
        self._on_finish = on_finish
        self._on_retry = on_retry
        self.open_streams = 0
        self._keys = RequestKeys()  # each stream's key: its reservation's and its usage record's id

    async def Process(  # noqa: N802 (gRPC name)
        self, _requests: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        flow = PickerFlow(self._gateway, self._options, self._on_retry, self._keys())
        started = time.perf_counter()
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
            flow.finish()
            if self._on_finish is not None:
                self._on_finish(flow, time.perf_counter() - started)
