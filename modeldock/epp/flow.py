"""The Endpoint Picker adapter: one PickerFlow per ext_proc stream from a gateway's Envoy.

The gateway (Envoy Gateway + Envoy AI Gateway, or Istio) sends every phase: request headers, the
body in chunks (FULL_DUPLEX_STREAMED) or at once (BUFFERED), trailers, then the response's. The flow
collects the body, calls the director (`Gateway.route`, the same call modeldock's own bootstrap
makes) and renders `Routed` in the protocol: the destination in the `x-gateway-destination-endpoint`
header and in `envoy.lb` metadata, the client's credential and routing headers removed. In
FULL_DUPLEX_STREAMED the request-headers answer is held until the body is in, then sent with the
body echoed after it; every response chunk is echoed as it comes. The served-endpoint report
(Istio) moves the in-flight count; `finish()` releases what the request holds, once, when the
stream ends (which the gateway makes the end of the HTTP stream: every phase is sent). A request
that needs its usage has it read from the response (usage.py) and settled with it; without it
(no usage seen, a cut stream) it is charged its whole reservation. The flow is the request's
`Outcome` (gateway/lifecycle.py); the registry (`Lifecycle`, settling at each stream end in this
mode) keys it, counts its retries and settles it.

Modes are read from the stream's first message (`protocol_config`, which Envoy 1.40 sends).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from enum import Enum
from weakref import WeakKeyDictionary

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from modeldock import replies
from modeldock.epp import protocol
from modeldock.epp.usage import UsageScanner
from modeldock.errors import PayloadTooLarge, Rejection, Unavailable
from modeldock.gateway import MODELS_PATH, Gateway, check_route
from modeldock.gateway.lifecycle import Lifecycle, Outcome, Stage
from modeldock.gateway.request import PRIORITY_HEADER, read_head
from modeldock.gateway.settlement import UsageReport
from modeldock.types import Endpoint

log = logging.getLogger("modeldock.epp")

_DUPLEX = pm.ProcessingMode.FULL_DUPLEX_STREAMED
_BUFFERED = (pm.ProcessingMode.BUFFERED, pm.ProcessingMode.BUFFERED_PARTIAL)
_NONE: list[ep.ProcessingResponse] = []


@dataclass(frozen=True)
class PickerOptions:
    # Answer the ranked list (primary, then fallbacks) instead of the primary alone. Only for a
    # gateway that routes on envoy.lb metadata with override_host (Istio): an ORIGINAL_DST cluster
    # (Envoy AI Gateway) takes exactly one ip:port from the header.
    fallbacks: bool = False


# A flow made without a registry (a test, a benchmark) shares its gateway's: settling at each stream end.
_OWN: WeakKeyDictionary[Gateway, Lifecycle] = WeakKeyDictionary()


def _lifecycle_of(gateway: Gateway) -> Lifecycle:
    lifecycle = _OWN.get(gateway)
    if lifecycle is None:
        lifecycle = _OWN[gateway] = Lifecycle(gateway, await_reports=False)
    return lifecycle


class PickerPhase(Enum):
    HEADERS = 1  # waiting for the request headers
    BODY = 2  # collecting the body
    ROUTED = 3  # answered with a destination; the response passes through
    DONE = 4  # answered without one (an immediate response)


class PickerFlow(Outcome):
    """One stream from the gateway. `lifecycle` keys it, hears its retries and settles it at `finish()`;
    without one (a test) its gateway's own, which settles at the stream end, as picker mode does."""

    def __init__(self, gateway: Gateway, options: PickerOptions = PickerOptions(), *,
                 lifecycle: Lifecycle | None = None) -> None:
        super().__init__()
        self._gateway = gateway
        self._lifecycle = _lifecycle_of(gateway) if lifecycle is None else lifecycle
        self._lifecycle.open(self)  # the key: its reservation's and its usage record's id
        self._options = options
        self._phase = PickerPhase.HEADERS
        self._duplex_request = self._duplex_response = True
        self._chunks: list[bytes] = []
        self._size = 0
        self._names: list[str] = []
        self._subset: frozenset[Endpoint] | None = None
        self._scanner: UsageScanner | None = None  # reads the response's usage (a request that needs it)
        self._response_status = 0
        self._response_ended = False
        self._asked = False  # the director was called (and logs its refusals)

    async def handle(self, request: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        """The answers to one message, in order; none while a FULL_DUPLEX_STREAMED body is coming in."""
        kind = request.WhichOneof("request")
        phase = self._phase
        if phase is PickerPhase.ROUTED:  # the hot path: response chunks
            if kind == "response_body":
                body = request.response_body
                if self._scanner is not None:
                    return self._scan(self._scanner, body)
                if self._duplex_response:
                    return [protocol.echo_chunk(kind, body.body, body.end_of_stream)]
                return [ep.ProcessingResponse(response_body=ep.BodyResponse())]
            if kind == "response_headers":
                return [self._on_response_headers(request)]
            if kind == "response_trailers" and self._scanner is not None:
                return self._on_response_trailers(self._scanner, request)
            return [replies.continue_other(request)]
        try:
            if phase is PickerPhase.HEADERS and kind == "request_headers":
                return await self._on_request_headers(request)
            if phase is PickerPhase.BODY and kind == "request_body":
                body = request.request_body
                self._add(body.body)
                if body.end_of_stream or not self._duplex_request:
                    return await self._route(trailers=False)
                return _NONE
            if phase is PickerPhase.BODY and kind == "request_trailers":
                return await self._route(trailers=True)
            if phase is PickerPhase.DONE:
                return [replies.continue_other(request)]
            raise Unavailable("The gateway sent the request out of order.", code="gateway_misconfigured",
                              detail=f"{kind} in phase {phase.name}")
        except Rejection as rejection:
            self._phase = PickerPhase.DONE
            self._chunks = []  # nothing goes on: drop what was held
            self.rejected(rejection)
            if not self._asked:  # the director logs its own refusals
                self._log(rejection)
            return [replies.rejection_response(rejection)]

    # -- request ---------------------------------------------------------

    async def _on_request_headers(self, request: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if request.HasField("protocol_config"):
            config = request.protocol_config
            self._duplex_request = config.request_body_mode == _DUPLEX
            self._duplex_response = config.response_body_mode == _DUPLEX
            if not self._duplex_request and config.request_body_mode not in _BUFFERED:
                raise Unavailable("The gateway is not set up to send request bodies.", code="gateway_misconfigured",
                                  detail=f"request_body_mode {config.request_body_mode}")
        pairs = protocol.header_pairs(request.request_headers)
        head = read_head(pairs)
        # The queue class asked for, as the bootstrap reads it (Envoy joins a repeated header with ","):
        # both modes make the same class decision (gateway/request.py head_from_attributes).
        priority = ",".join(v for k, v in pairs if k == PRIORITY_HEADER).strip()
        if priority:
            head = replace(head, priority=priority)
        self.head = head
        self._names = [k for k, _ in pairs]
        hint = protocol.lb_value(request, protocol.SUBSET_KEY)
        if hint is not None:
            self._subset = protocol.subset_endpoints(hint)
            if not self._subset:
                raise Unavailable("No endpoint the gateway allows for this request is ready. Retry shortly.",
                                  code="no_ready_endpoints", detail="empty subset hint")
        if head.path == MODELS_PATH:
            self._asked = True
            tenant, names = self._gateway.models(head)
            self._phase = PickerPhase.DONE
            self.listed_models(tenant.id)
            return [replies.models_response(names)]
        check_route(head)  # 404 / 400 before any body is collected
        if head.content_length is not None:
            protocol_limit(head.content_length, self._gateway.max_body_bytes)
        self._phase = PickerPhase.BODY
        if request.request_headers.end_of_stream:
            return await self._route(trailers=False)  # no body: the director refuses it (400)
        if self._duplex_request:
            return _NONE  # the answer waits for the body: it carries the destination
        return [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]

    def _add(self, chunk: bytes) -> None:
        self._size += len(chunk)
        protocol_limit(self._size, self._gateway.max_body_bytes)
        self._chunks.append(chunk)

    async def _route(self, *, trailers: bool) -> list[ep.ProcessingResponse]:
        assert self.head is not None
        body = b"".join(self._chunks)
        self._chunks = []
        self._asked = True
        routed = await self._gateway.route(self.head, body, self.rid, subset=self._subset)
        self._phase = PickerPhase.ROUTED
        self.proxied(routed)
        to = routed.destination
        destination = to.endpoints if self._options.fallbacks else to.primary.address
        sent = to.body if to.body is not None else body
        if not self._duplex_request:
            return [protocol.routed_body(destination, to.body, len(sent), self._names, to.upstream_auth)]
        out = [protocol.routed_headers(destination, len(sent), self._names, to.upstream_auth)]
        out.extend(protocol.streamed_chunks("request_body", sent, end_of_stream=not trailers))
        if trailers:
            out.append(ep.ProcessingResponse(request_trailers=ep.TrailersResponse()))
        return out

    # -- response --------------------------------------------------------

    def _on_response_headers(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        routed = self.routed
        assert routed is not None
        served = protocol.lb_value(request, protocol.SERVED_KEY)
        if served is not None:
            self.served_on(protocol.served_address(served))
        if routed.usage.wants_usage:
            self._scanner = self._usage_scanner(request.response_headers, routed.usage.drop_usage)
        return protocol.response_headers(routed.destination.route_metadata)

    def _usage_scanner(self, headers: ep.HttpHeaders, drop: bool) -> UsageScanner | None:
        """A scanner for a response body that can carry usage: SSE or JSON, not compressed."""
        content_type = encoding = ""
        for key, value in protocol.header_pairs(headers):
            if key == ":status":
                self._response_status = int(value) if value.isdecimal() and len(value) == 3 else 0
            elif key == "content-type":
                content_type = value.lower()
            elif key == "content-encoding":
                encoding = value.strip().lower()
        if headers.end_of_stream or encoding not in ("", "identity"):
            return None
        if content_type.startswith("text/event-stream"):
            return UsageScanner(sse=True, drop=drop, hold=self._duplex_response)
        if "json" in content_type:
            return UsageScanner(sse=False, drop=False)
        return None

    def _scan(self, scanner: UsageScanner, body: ep.HttpBody) -> list[ep.ProcessingResponse]:
        end = body.end_of_stream
        self._response_ended = end
        out = scanner.feed(body.body, end)
        if self._duplex_response:
            if not out and not end and scanner.drops:
                return _NONE  # an incomplete event is held: it goes on with the next chunk
            return [protocol.echo_chunk("response_body", out, end)]
        response = ep.ProcessingResponse(response_body=ep.BodyResponse())
        if out != body.body:  # the usage event dropped from the buffered body
            response.response_body.response.body_mutation.body = out
        return [response]

    def _on_response_trailers(self, scanner: UsageScanner, request: ep.ProcessingRequest,
                              ) -> list[ep.ProcessingResponse]:
        """Trailers end the body: what is still held goes on before their answer."""
        self._response_ended = True
        out = scanner.feed(b"", True)
        answer = replies.continue_other(request)
        if out and scanner.drops and self._duplex_response:
            return [protocol.echo_chunk("response_body", out, False), answer]
        return [answer]

    def served_on(self, address: str) -> bool:
        """The gateway reports `address` served the request: count it there (a retry moved it).
        False when nothing moved."""
        return self._phase is PickerPhase.ROUTED and self._lifecycle.moved(self, address)

    def finish(self) -> None:
        """The stream ended (the HTTP stream completed, failed or was cancelled): release, then end it
        in the registry, which settles it. Idempotent."""
        if self.stage is Stage.ENDED:
            return
        self._phase = PickerPhase.DONE
        self._chunks = []
        routed = self.routed
        report = None
        if routed is not None:
            routed.release()
            # A gateway it did not configure sends no usage report: the usage read from the response
            # settles it; none seen (not asked for, a cut stream) -> the reservation is charged whole
            # and the usage record says `estimated` (docs/mesh.md).
            usage = self._scanner.usage if self._scanner is not None else None
            report = None if usage is None else UsageReport(
                rid=self.rid, usage=usage, reached_backend=True, status=self._response_status,
                cancelled=not self._response_ended, endpoint=routed.holdings.lease.endpoint.address,
                attempts=2 if self.served_by else 1)
            self._scanner = None
        self._lifecycle.ended(self, report)

    def _log(self, rejection: Rejection) -> None:
        rid = self.head.request_id if self.head and self.head.request_id else "-"
        log.info("rejected request %s: %d %s%s", rid, rejection.status, rejection.code,
                 f": {rejection.detail}" if rejection.detail else "")


def protocol_limit(size: int, limit: int) -> None:
    """413 as soon as the body (or its announced length) is over the limit: chunks are not buffered past it."""
    if size > limit:
        raise PayloadTooLarge(f"Request body is over the limit of {limit} bytes.")
