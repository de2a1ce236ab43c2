"""The ext_proc stream state machine: one RequestFlow per HTTP request.

Envoy sends two messages per completion request (docs/envoy.md): the buffered
request body, with the request's method, path, id and Authorization header as
attributes (authenticate, parse, allowlist, pick), then the response headers
(learn which endpoint served it). `GET /v1/models` is the one route whose
request headers are sent; a request without a body reaches ext_proc only as
Envoy's own reply, which becomes a JSON error here. The flow owns the request's
lease and releases it exactly once, when the ext_proc stream ends, which Envoy
makes coincide with the end of the HTTP stream.
"""

from __future__ import annotations

import json
import logging
from enum import Enum

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from modeldock.config import TenantConfig
from modeldock.errors import BadRequest, NotFound, PayloadTooLarge, Rejection, Unavailable
from modeldock.extproc import responses
from modeldock.extproc.gateway import Gateway
from modeldock.extproc.request import (
    RequestHead,
    ascii_int,
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
UPSTREAM_ADDRESS = "upstream.address"
CODE_DETAILS = "response.code_details"  # "via_upstream" unless Envoy wrote the reply itself


class Phase(Enum):
    START = 1
    UPSTREAM = 2
    DONE = 3


def _headers(header_map: ep.HttpHeaders) -> list[tuple[str, str]]:
    return [
        (h.key, h.raw_value.decode("utf-8", "surrogateescape") if h.raw_value else h.value)
        for h in header_map.headers.headers
    ]


def _status(headers: ep.HttpHeaders) -> int:
    for h in headers.headers.headers:
        if h.key == ":status":
            return ascii_int(h.raw_value.decode("ascii", "replace") if h.raw_value else h.value) or 0
    return 0


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
        self.served_by = ""  # the endpoint Envoy reports, after any retries
        self.outcome = "incomplete"
        self.status = 0

    async def handle(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        try:
            kind = request.WhichOneof("request")
            if kind == "request_body" and self._phase is Phase.START:
                return await self._on_request_body(request)
            if kind == "response_headers" and self._phase is Phase.UPSTREAM:
                return self._on_response_headers(request)
            if kind == "response_headers" and self._phase is Phase.START:
                return self._on_local_reply(request)
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
        self._phase = Phase.UPSTREAM
        return responses.route_request_body(cluster_name(model), pick.endpoint_list, new_body)

    def _on_response_headers(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        self._phase = Phase.DONE
        self.outcome = "proxied"
        self.status = _status(request.response_headers)
        attrs = _attributes(request)
        served = attrs.get(UPSTREAM_ADDRESS)
        if served and self.lease is not None:
            self.served_by = served
            self.lease.move_to(served)
        details = attrs.get(CODE_DETAILS, "via_upstream")
        if details != "via_upstream" and self.status >= 400:
            # Envoy's own reply: every endpoint failed before answering (retries spent,
            # no healthy host). Say so as an OpenAI error instead of Envoy's plain text.
            self.outcome, self.status = "upstream_failed", Unavailable.status
            log.warning("request %s: no endpoint of model %s answered (%s)", self._request_id, self.model, details)
            return responses.rejection_response(Unavailable(
                f"No endpoint of model `{self.model}` could take the request ({details}). Retry shortly.",
                code="upstream_unavailable", headers={"Retry-After": "1"}))
        if self.ticket is not None and self.ticket.headers:
            return responses.continue_response_headers(responses.header_mutation(self.ticket.headers))
        return responses.continue_response_headers()

    def _on_local_reply(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        """Envoy answered by itself before ext_proc saw a body: say why, as JSON."""
        self._phase = Phase.DONE
        status = _status(request.response_headers)
        if status == 413:  # the body overflowed Envoy's buffer
            limit = self._gateway.max_body_bytes
            raise PayloadTooLarge(f"Request body is over the limit of {limit} bytes.")
        head = self.head = head_from_attributes(_attributes(request))
        if status == 404:
            # Envoy's catch-all route: no body, so ext_proc never picked a route.
            _check_route(head)
            raise BadRequest("Request body is empty; send a JSON object with a `model`.", code="invalid_body")
        self.outcome, self.status = "local_reply", status
        return responses.continue_response_headers()

    @property
    def _request_id(self) -> str:
        return self.head.request_id if self.head and self.head.request_id else "-"

    @property
    def retried(self) -> bool:
        """Envoy moved the request off the primary before the first byte."""
        return bool(self.served_by) and self.served_by != self.primary

    def finish(self) -> None:
        """The HTTP stream ended (completed, failed or cancelled). Idempotent."""
        if self.lease is not None:
            self.lease.release()
        if self.ticket is not None:
            self.ticket.release()
