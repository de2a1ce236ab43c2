"""The ext_proc adapter: one RequestFlow per ext_proc stream (one HTTP request).

It translates Envoy's messages into the director's calls (`Gateway.route`,
`Gateway.models`, modeldock/gateway/) and their answers back into protobuf, and
holds only protocol state: the phase, the `Routed` result, and the outcome,
status, tenant and model for metrics.

Envoy sends one message per completion request (docs/envoy.md): the buffered
request body, with the request's method, path, id and Authorization header as
attributes. `GET /v1/models` is the one route whose request headers are sent
instead. A request without a body never reaches ext_proc (Envoy answers it with a
JSON error itself). When Envoy retries onto a fallback, its access log reports the
new endpoint (`retried_on`). The flow releases what the routed request holds
exactly once, when the ext_proc stream ends, which Envoy makes coincide with the
end of the HTTP stream. What it records (the key, the `Routed` result, the outcome) is
the `Outcome` both adapters share (gateway/lifecycle.py); the registry (`Lifecycle`) keys,
registers and settles it.
"""

from __future__ import annotations

import logging
from enum import Enum

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from modeldock import replies
from modeldock.admission.limits import Ticket
from modeldock.config import TenantConfig
from modeldock.errors import BadRequest, Rejection
from modeldock.extproc import responses
from modeldock.gateway import MODELS_PATH, Gateway, check_route
from modeldock.gateway.lifecycle import Lifecycle, Outcome, Stage
from modeldock.gateway.request import head_from_attributes, read_head
from modeldock.picking import Lease

log = logging.getLogger("modeldock.extproc")

ATTRIBUTES = "envoy.filters.http.ext_proc"


class FlowPhase(Enum):
    START = 1
    ROUTED = 2  # handed to Envoy with its endpoints; the stream ends with the HTTP stream
    DONE = 3


def _headers(header_map: ep.HttpHeaders) -> list[tuple[str, str]]:
    return [
        (h.key, h.raw_value.decode("utf-8", "surrogateescape") if h.raw_value else h.value)
        for h in header_map.headers.headers
    ]


def _attributes(request: ep.ProcessingRequest) -> dict[str, str]:
    """Envoy's attributes for this message; a missing one (no such header) is left out,
    and one that is not a string reads as empty."""
    attrs = request.attributes.get(ATTRIBUTES)
    if attrs is None:
        return {}
    return {k: v.string_value for k, v in attrs.fields.items()}


def _out_of_order() -> BadRequest:
    # Nothing may reach an upstream before authentication and picking.
    return BadRequest("Request arrived out of order.", code="invalid_request")


class RequestFlow(Outcome):
    """One ext_proc stream. With a `lifecycle`, the registry keys it, holds it once routed (for Envoy's
    retry reports) and settles it when `finish()` ends it; without one (a test) it only releases."""

    def __init__(self, gateway: Gateway, rid: str = "", *, lifecycle: Lifecycle | None = None) -> None:
        super().__init__(rid)
        self._gateway = gateway
        self._lifecycle = lifecycle
        if lifecycle is not None:
            lifecycle.open(self)
        self._phase = FlowPhase.START

    async def handle(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        try:
            kind = request.WhichOneof("request")
            if kind == "request_body" and self._phase is FlowPhase.START:
                return await self._on_request_body(request)
            if kind == "request_headers" and self._phase is FlowPhase.START:
                return self._on_request_headers(request.request_headers)
            if self._phase is FlowPhase.START:
                raise self._logged(_out_of_order())
            return replies.continue_other(request)
        except Rejection as rejection:
            self._phase = FlowPhase.DONE
            self.rejected(rejection)
            return replies.rejection_response(rejection)

    def _on_request_headers(self, headers: ep.HttpHeaders) -> ep.ProcessingResponse:
        """Only `/v1/models` sends its headers (a per-route override in Envoy)."""
        head = self.head = read_head(_headers(headers))
        if head.path != MODELS_PATH:
            try:
                check_route(head)
            except Rejection as rejection:
                raise self._logged(rejection) from None
            # A completion route must not send headers: its body carries the request.
            raise self._logged(_out_of_order())
        tenant, names = self._gateway.models(head)
        self._phase = FlowPhase.DONE
        self.listed_models(tenant.id)
        return replies.models_response(names)

    async def _on_request_body(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        head = self.head = head_from_attributes(_attributes(request))
        routed = await self._gateway.route(head, request.request_body.body, self.rid)
        self._phase = FlowPhase.ROUTED
        self.proxied(routed)
        if self._lifecycle is not None:
            self._lifecycle.routed(self)  # before Envoy has the answer: no retry report can come first
        to, usage = routed.destination, routed.usage
        return responses.route_request_body(to.cluster, to.endpoints, to.body, routed.model, to.route_metadata,
                                            rid=self.rid, tenant=routed.tenant.id, upstream_auth=to.upstream_auth,
                                            usage=usage.wants_usage, drop_usage=usage.drop_usage)

    def _logged(self, rejection: Rejection) -> Rejection:
        """A refusal of the protocol's own (the director logs the rest)."""
        log.info("rejected request %s: %d %s", self._request_id, rejection.status, rejection.code)
        return rejection

    @property
    def _request_id(self) -> str:
        return self.head.request_id if self.head and self.head.request_id else "-"

    # What the routed request holds (None until routed).
    @property
    def lease(self) -> Lease | None:
        return self.routed.holdings.lease if self.routed is not None else None

    @property
    def ticket(self) -> Ticket | None:
        return self.routed.holdings.ticket if self.routed is not None else None

    @property
    def tenant(self) -> TenantConfig | None:
        return self.routed.tenant if self.routed is not None else None

    @property
    def model(self) -> str | None:
        return self.routed.model if self.routed is not None else None

    def retried_on(self, address: str) -> bool:
        """Envoy retried the request on `address` ("ip:port") before the first byte: count it there.
        False when nothing moved (not routed, ended, not an endpoint, or where it is counted already)."""
        return self._phase is FlowPhase.ROUTED and self.moved_to(address)

    def finish(self) -> None:
        """The HTTP stream ended (completed, failed or cancelled): release, then end it in the registry.
        Idempotent."""
        if self.stage is Stage.ENDED:
            return
        self._phase = FlowPhase.DONE
        if self.routed is not None:
            self.routed.release()
        if self._lifecycle is not None:
            self._lifecycle.ended(self)
