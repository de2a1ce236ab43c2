"""The ext_proc stream state machine: one RequestFlow per HTTP request.

Phases: request headers (route, authenticate, strip secrets), request body
(parse, allowlist, pick), response headers (learn which endpoint served it).
The flow owns the request's lease and releases it exactly once, when the
ext_proc stream ends, which Envoy makes coincide with the end of the HTTP
stream (see docs/envoy.md).
"""

from __future__ import annotations

import json
import logging
from enum import Enum

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from modeldock.config import TenantConfig
from modeldock.errors import BadRequest, NotFound, PayloadTooLarge, Rejection
from modeldock.extproc import responses
from modeldock.extproc.gateway import Gateway
from modeldock.extproc.request import RequestHead, ascii_int, bearer_key, check_length, parse_body, read_head
from modeldock.admission.limits import Ticket
from modeldock.picking import Lease
from modeldock.xds.resources import CLUSTER_HEADER, DESTINATION_HEADER, cluster_name

log = logging.getLogger("modeldock.extproc")

COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
MODELS_PATH = "/v1/models"
# Never forwarded upstream: secrets, and headers that steer routing.
STRIPPED = ("authorization", DESTINATION_HEADER, CLUSTER_HEADER)
UPSTREAM_ADDRESS = "upstream.address"


class Phase(Enum):
    HEADERS = 1
    BODY = 2
    UPSTREAM = 3
    DONE = 4


def _headers(header_map: ep.HttpHeaders) -> list[tuple[str, str]]:
    return [
        (h.key, h.raw_value.decode("utf-8", "surrogateescape") if h.raw_value else h.value)
        for h in header_map.headers.headers
    ]


def _status(headers: ep.HttpHeaders) -> int:
    for key, value in _headers(headers):
        if key == ":status":
            return ascii_int(value) or 0
    return 0


class RequestFlow:
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._phase = Phase.HEADERS
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
            if kind == "request_headers" and self._phase is Phase.HEADERS:
                return self._on_request_headers(request.request_headers)
            if kind == "request_body" and self._phase is Phase.BODY:
                return await self._on_request_body(request.request_body)
            if kind == "response_headers" and self._phase is Phase.UPSTREAM:
                return self._on_response_headers(request)
            if kind == "response_headers" and self._phase is Phase.BODY:
                return self._on_local_reply(request.response_headers)
            if self._phase in (Phase.HEADERS, Phase.BODY):
                # Nothing may reach an upstream before authentication and picking.
                raise BadRequest("Request arrived out of order.", code="invalid_request")
            return responses.continue_other(request)
        except Rejection as rejection:
            self._phase = Phase.DONE
            self.outcome, self.status = "rejected", rejection.status
            log.info(
                "rejected request %s: %d %s (tenant=%s model=%s)",
                self.head.request_id if self.head else "-", rejection.status, rejection.code,
                self.tenant.id if self.tenant else "-", self.model or "-",
            )
            return responses.rejection_response(rejection)

    def _on_request_headers(self, headers: ep.HttpHeaders) -> ep.ProcessingResponse:
        head = self.head = read_head(_headers(headers))
        if head.path == MODELS_PATH and head.method == "GET":
            tenant = self.tenant = self._gateway.authenticate(bearer_key(head.authorization))
            data = [
                {"id": name, "object": "model", "created": 0, "owned_by": "modeldock"}
                for name in self._gateway.visible_models(tenant)
            ]
            self._phase = Phase.DONE
            self.outcome, self.status = "models", 200
            return responses.json_response(200, {"object": "list", "data": data})
        if head.path not in COMPLETION_PATHS:
            raise NotFound(f"Unknown path {head.path!r}.", code="unknown_url")
        if head.method != "POST":
            raise BadRequest(f"Use POST for {head.path}.", code="method_not_allowed")
        self.tenant = self._gateway.authenticate(bearer_key(head.authorization))
        if head.content_length is not None:
            check_length(head.content_length, self._gateway.max_body_bytes)
        if headers.end_of_stream:
            raise BadRequest("Request body is empty; send a JSON object with a `model`.", code="invalid_body")
        self._phase = Phase.BODY
        return responses.continue_request_headers(responses.header_mutation(remove=STRIPPED))

    async def _on_request_body(self, body: ep.HttpBody) -> ep.ProcessingResponse:
        assert self.tenant is not None
        check_length(len(body.body), self._gateway.max_body_bytes)
        data = parse_body(body.body)
        model = self.model = str(data["model"])
        config = self._gateway.resolve_model(self.tenant, model)
        new_body: bytes | None = None
        set_headers = {}
        if config.upstream_name != model:
            data["model"] = config.upstream_name
            new_body = json.dumps(data, separators=(",", ":")).encode()
            set_headers["content-length"] = str(len(new_body))
        self.ticket = await self._gateway.admission.admit(self.tenant, model)
        # No await from here on: pick and count happen in one step.
        pick = self._gateway.pick(model)
        self.lease = pick.lease
        self.primary = pick.primary.address
        self._phase = Phase.UPSTREAM
        set_headers[DESTINATION_HEADER] = pick.header_value
        set_headers[CLUSTER_HEADER] = cluster_name(model)
        return responses.continue_request_body(
            responses.header_mutation(set_headers), body=new_body, clear_route_cache=True
        )

    def _on_response_headers(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        self._phase = Phase.DONE
        self.outcome = "proxied"
        self.status = _status(request.response_headers)
        attrs = request.attributes.get("envoy.filters.http.ext_proc")
        if attrs is not None and self.lease is not None:
            served = attrs.fields.get(UPSTREAM_ADDRESS)
            if served is not None and served.string_value:
                self.served_by = served.string_value
                self.lease.move_to(served.string_value)
        if self.ticket is not None and self.ticket.headers:
            return responses.continue_response_headers(responses.header_mutation(self.ticket.headers))
        return responses.continue_response_headers()

    def _on_local_reply(self, headers: ep.HttpHeaders) -> ep.ProcessingResponse:
        """Envoy answered by itself before the body reached us: its buffer overflowed (413)."""
        self._phase = Phase.DONE
        self.outcome, self.status = "rejected", _status(headers)
        if self.status == 413:
            limit = self._gateway.max_body_bytes
            return responses.rejection_response(PayloadTooLarge(f"Request body is over the limit of {limit} bytes."))
        return responses.continue_response_headers()

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
