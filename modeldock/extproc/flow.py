"""The ext_proc stream state machine: one RequestFlow per HTTP request.

Envoy sends one message per completion request (docs/envoy.md): the buffered
request body, with the request's method, path, id and Authorization header as
attributes (authenticate, parse, allowlist, pick). `GET /v1/models` is the one
route whose request headers are sent instead. A request without a body never
reaches ext_proc (Envoy answers it with a JSON error itself). When Envoy retries
onto a fallback, its access log reports the new endpoint (`retried_on`). The flow
owns the request's lease and releases it exactly once, when the ext_proc stream
ends, which Envoy makes coincide with the end of the HTTP stream.
"""

from __future__ import annotations

import json
import logging
from enum import Enum

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from modeldock.config import TenantConfig
from modeldock.errors import BadRequest, NotFound, Rejection
from modeldock.extproc import responses
from modeldock.extproc.gateway import Gateway
from modeldock.extproc.request import (
    RequestHead,
    bearer_key,
    check_length,
    head_from_attributes,
    parse_body,
    read_head,
)
from modeldock.admission.limits import Ticket
from modeldock.picking import Lease
from modeldock.picking.prefix import prompt_blocks
from modeldock.xds.resources import cluster_name

log = logging.getLogger("modeldock.extproc")

COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
MODELS_PATH = "/v1/models"
ATTRIBUTES = "envoy.filters.http.ext_proc"


class Phase(Enum):
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


def _check_route(head: RequestHead) -> None:
    if head.path not in COMPLETION_PATHS:
        raise NotFound(f"Unknown path {head.path!r}.", code="unknown_url")
    if head.method != "POST":
        raise BadRequest(f"Use POST for {head.path}.", code="method_not_allowed")


class RequestFlow:
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._phase = Phase.START
        self.head: RequestHead | None = None
        self.tenant: TenantConfig | None = None
        self.model: str | None = None
        self.lease: Lease | None = None
        self.ticket: Ticket | None = None
        self.primary = ""
        self.served_by = ""  # set when Envoy reports a retry onto another endpoint
        self.outcome = "incomplete"
        self.status = 0

    async def handle(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        try:
            kind = request.WhichOneof("request")
            if kind == "request_body" and self._phase is Phase.START:
                return await self._on_request_body(request)
            if kind == "request_headers" and self._phase is Phase.START:
                return self._on_request_headers(request.request_headers)
            if self._phase is Phase.START:
                # Nothing may reach an upstream before authentication and picking.
                raise BadRequest("Request arrived out of order.", code="invalid_request")
            return responses.continue_other(request)
        except Rejection as rejection:
            self._phase = Phase.DONE
            self.outcome, self.status = "rejected", rejection.status
            log.info(
                "rejected request %s: %d %s (tenant=%s model=%s)", self._request_id, rejection.status,
                rejection.code, self.tenant.id if self.tenant else "-", self.model or "-",
            )
            return responses.rejection_response(rejection)

    def _on_request_headers(self, headers: ep.HttpHeaders) -> ep.ProcessingResponse:
        """Only `/v1/models` sends its headers (a per-route override in Envoy)."""
        head = self.head = read_head(_headers(headers))
        if head.path != MODELS_PATH:
            _check_route(head)
            # A completion route must not send headers: its body carries the request.
            raise BadRequest("Request arrived out of order.", code="invalid_request")
        if head.method != "GET":
            raise BadRequest(f"Use GET for {head.path}.", code="method_not_allowed")
        tenant = self.tenant = self._gateway.authenticate(bearer_key(head.authorization))
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "modeldock"}
            for name in self._gateway.visible_models(tenant)
        ]
        self._phase = Phase.DONE
        self.outcome, self.status = "models", 200
        return responses.json_response(200, {"object": "list", "data": data})

    async def _on_request_body(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        head = self.head = head_from_attributes(_attributes(request))
        _check_route(head)
        tenant = self.tenant = self._gateway.authenticate(bearer_key(head.authorization))
        raw = request.request_body.body
        check_length(len(raw), self._gateway.max_body_bytes)
        data = parse_body(raw)
        model = self.model = str(data["model"])
        config = self._gateway.resolve_model(tenant, model)
        new_body: bytes | None = None
        if config.upstream_name != model:
            data["model"] = config.upstream_name
            new_body = json.dumps(data, separators=(",", ":")).encode()
        self._gateway.check_dispatchable(model)
        prefix = prompt_blocks(data)
        self.ticket = await self._gateway.admission.admit(tenant, model)
        # No await from here on: pick and count happen in one step.
        pick = self._gateway.pick(model, prefix)
        self.lease = pick.lease
        self.primary = pick.primary.address
        self._phase = Phase.ROUTED
        self.outcome = "proxied"
        return responses.route_request_body(cluster_name(model), pick.endpoint_list, new_body, model,
                                            self.ticket.headers)

    @property
    def _request_id(self) -> str:
        return self.head.request_id if self.head and self.head.request_id else "-"

    def retried_on(self, address: str) -> bool:
        """Envoy retried the request on `address` ("ip:port") before the first byte: count it there.
        False when nothing moved (not routed, ended, not an endpoint, or where it is counted already)."""
        if self.lease is None or self._phase is not Phase.ROUTED or not self.lease.move_to(address):
            return False
        self.served_by = self.lease.endpoint.address
        return True

    @property
    def retried(self) -> bool:
        """Envoy moved the request off the primary before the first byte."""
        return bool(self.served_by) and self.served_by != self.primary

    def finish(self) -> None:
        """The HTTP stream ended (completed, failed or cancelled). Idempotent."""
        self._phase = Phase.DONE
        if self.lease is not None:
            self.lease.release()
        if self.ticket is not None:
            self.ticket.release()
