"""grpc.aio glue for ext_proc: one RequestFlow per stream, finished when the stream ends."""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from modeldock.extproc.flow import RequestFlow
from modeldock.gateway import Finished, Gateway
from modeldock.gateway.settlement import GRACE_SECONDS, PendingSettlements, UsageReport

log = logging.getLogger("modeldock.extproc")


# The generated servicer base is untyped (xds-protos ships no stubs).
class ExtProcServicer(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, gateway: Gateway, on_finish: Callable[[RequestFlow, float], None] | None = None,
                 on_retry: Callable[[RequestFlow], None] | None = None, *, settle_grace: float = GRACE_SECONDS,
                 ) -> None:
        self._gateway = gateway
        self._on_finish = on_finish
        self._on_retry = on_retry
        self.open_streams = 0
        # Routed requests by the key this replica gave them (never the client's x-request-id, which
        # two live requests may share), for Envoy's retry reports (attempts.py).
        self._routed: dict[str, RequestFlow] = {}
        # Keys unique across replicas and restarts: a random per-process prefix and a counter.
        self._key_prefix = secrets.token_hex(6) + "-"
        self._counter = itertools.count(1)
        # Requests whose stream ended, waiting for Envoy's usage report (token budgets, usage records).
        self.settlements: PendingSettlements[Finished] = PendingSettlements(
            gateway.clock, gateway.settle, self._routed.__contains__, grace=settle_grace)

    def usage_reported(self, report: UsageReport) -> None:
        """Envoy's usage log entry for a request; acted on only by the replica holding it."""
        self.settlements.reported(report)

    def retried(self, rid: str, address: str) -> None:
        """Envoy retried the request this replica keyed `rid` on `address`; ignored unless it is ours."""
        flow = self._routed.get(rid)
        if flow is None:
            return
        if flow.retried_on(address) and self._on_retry is not None:
            self._on_retry(flow)

    async def Process(  # noqa: N802 (gRPC name)
        self,
        _requests: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        # context.read()/write() rather than an async generator: one fewer
        # coroutine hop per message (benchmarks/extproc_cost.py).
        rid = f"{self._key_prefix}{next(self._counter)}"
        flow = RequestFlow(self._gateway, rid)
        started = time.perf_counter()
        self.open_streams += 1
        registered = False
        try:
            while True:
                request = await context.read()
                if request is grpc.aio.EOF:
                    break
                response = await flow.handle(request)
                if not registered and flow.routed is not None:
                    # Before Envoy has the answer, so that no retry report can come first.
                    registered = True
                    self._routed[rid] = flow
                await context.write(response)
        except Exception:
            # A broken stream must not leak: the finally below still releases.
            log.exception("ext_proc stream failed")
        finally:
            # Envoy ends the stream when the HTTP stream ends, including client
            # disconnects (the handler is then cancelled).
            self.open_streams -= 1
            flow.finish()
            if registered:
                del self._routed[rid]
                finished = flow.finished()
                if finished is not None:
                    self.settlements.ended(rid, finished)
                else:
                    self.settlements.forget(rid)
            if self._on_finish is not None:
                self._on_finish(flow, time.perf_counter() - started)
