"""What only modeldock's own bootstrap gets: the routed request's metadata, and Envoy's own error replies.

A Rejection becomes an Envoy response in one of two places: `modeldock.replies.rejection_response`
(ext_proc's ImmediateResponse, shared with picker mode) and `local_reply_config` here (Envoy's own
replies, which ext_proc never sees: a body over the limit, a request without a body, every endpoint
failing before the first byte, ext_proc itself down), rendered into the bootstrap by modeldock/envoy.py.
"""

from __future__ import annotations

from collections.abc import Mapping

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from modeldock.errors import BadRequest, GatewayTimeout, NotFound, PayloadTooLarge, Rejection, Unavailable
from modeldock.xds.resources import DESTINATION_HEADER, LB_NAMESPACE, ROUTE_NAMESPACE

# A model's upstream credential, keyed by header name; Envoy sets the header from it, then blanks it
# (envoy/bootstrap.yaml: modeldock.route_from_metadata, modeldock.forget_upstream_auth).
UPSTREAM_AUTH_NAMESPACE = "modeldock.upstream_auth"

__all__ = ["UPSTREAM_AUTH_NAMESPACE", "local_reply_config", "route_request_body"]


def route_request_body(cluster: str, endpoints: str, body: bytes | None = None, model: str = "",
                       response_headers: Mapping[str, str] | None = None, *, rid: str = "",
                       tenant: str = "", upstream_auth: tuple[str, str] | None = None, usage: bool = False,
                       drop_usage: bool = False) -> ep.ProcessingResponse:
    """Send the request on: the cluster and endpoint list go to Envoy as dynamic metadata.

    With the header phase skipped, a body response cannot change request headers
    (Envoy ignores the mutation), but it must carry one for `clear_route_cache` to
    take effect, so that the route is matched again with the metadata present.
    `response_headers` (the x-ratelimit-* set) and `model` are metadata too: the route
    adds the headers to the response, and Envoy's own error reply names the model.
    `rid` (the gateway's key for the request) goes upstream as `x-modeldock-rid`, which is how
    Envoy's retry log names the request; `tenant` is for Envoy's access log. `upstream_auth`
    (header, value) is the model's backend credential, which Envoy sets after removing the client's.
    `usage`: Envoy's usage access log reports this request back (`modeldock:usage`); `drop_usage`: the
    gateway asked the backend for a usage chunk the client did not ask for, which Envoy's Lua filter drops.
    """
    response = ep.ProcessingResponse()
    common = response.request_body.response
    common.clear_route_cache = True
    common.header_mutation.SetInParent()
    # Filled field by field: Struct.update is several times slower.
    fields = response.dynamic_metadata.fields
    route = fields[ROUTE_NAMESPACE].struct_value.fields
    route["cluster"].string_value = cluster
    if model:
        route["model"].string_value = model
    if rid:
        route["rid"].string_value = rid
    if tenant:
        route["tenant"].string_value = tenant
    if usage:
        route["usage"].string_value = "1"
        if drop_usage:
            route["drop_usage"].string_value = "1"
    if response_headers:
        for key, value in response_headers.items():
            route[key].string_value = value
    if body is not None:
        common.body_mutation.body = body
        route["content_length"].string_value = str(len(body))
    fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = endpoints
    if upstream_auth is not None:
        fields[UPSTREAM_AUTH_NAMESPACE].struct_value.fields[upstream_auth[0]].string_value = upstream_auth[1]
    return response


# Envoy's own replies, as local_reply_config mappers (CEL filters, first match wins).
# Immediate responses from ext_proc carry details "modeldock_<status>" and pass as they are.
_NOT_OURS = "!response.code_details.startsWith('modeldock_')"
_COMPLETION = "(request.url_path == '/v1/chat/completions' || request.url_path == '/v1/completions')"
_ADMITTED = f"'{ROUTE_NAMESPACE}' in metadata.filter_metadata"  # ext_proc set the route metadata
_FALLBACK_ROUTE = f"response.code_details == 'direct_response' && !({_ADMITTED})"


def _mapper(expression: str, rejection: Rejection) -> dict[str, object]:
    mapper: dict[str, object] = {
        "filter": {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
            "expression": expression}}},
        "status_code": rejection.status,
        # json_format sets content-type: application/json and escapes what the
        # %...% operators insert (a path, Envoy's details).
        "body_format_override": {"json_format": rejection.body()},
    }
    if rejection.headers:
        mapper["headers_to_add"] = [{"header": {"key": k.lower(), "value": v}, "append_action":
                                     "OVERWRITE_IF_EXISTS_OR_ADD"} for k, v in rejection.headers.items()]
    return mapper


def local_reply_config(max_body_bytes: int) -> dict[str, object]:
    """HttpConnectionManager.local_reply_config: Envoy's own error replies as OpenAI JSON errors.

    Messages are plain: Envoy's details (`%RESPONSE_CODE_DETAILS%`, the upstream failure reason)
    go to the access log, never to the client.
    """
    retry = {"Retry-After": "1"}
    return {"mappers": [
        _mapper("response.code_details == 'request_payload_too_large'",
                PayloadTooLarge(f"Request body is over the limit of {max_body_bytes} bytes.")),
        # ext_proc answers every request it sees (admitted, or its own reply), so one that reached
        # the catch-all route although it had a body, or the model list's route, went past
        # ext_proc failing or gone (failure_mode_allow): nothing was checked, nothing sent upstream.
        _mapper(f"{_FALLBACK_ROUTE} && (request.size > 0 || request.url_path == '/v1/models')",
                _gateway_unavailable(retry)),
        # A request without a body never reaches ext_proc; the catch-all route answers it.
        _mapper(f"{_FALLBACK_ROUTE} && {_COMPLETION} && request.method == 'POST'",
                BadRequest("Request body is empty; send a JSON object with a `model`.", code="invalid_body")),
        _mapper(f"{_FALLBACK_ROUTE} && {_COMPLETION}",
                BadRequest("Use POST for %REQ(:PATH)%.", code="method_not_allowed")),
        _mapper(_FALLBACK_ROUTE, NotFound("Unknown path %REQ(:PATH)%.", code="unknown_url")),
        # ext_proc failing without failure_mode_allow (kept should the bootstrap ever fail closed).
        _mapper("response.code_details.startsWith('ext_proc')", _gateway_unavailable(retry)),
        # Admitted and sent, then the backend went silent before its headers (the route's idle_timeout,
        # listener.stream_idle_timeout_seconds): not "no endpoint could take it", which would send the
        # client looking for capacity; a cut after the headers is a cut stream, no reply.
        _mapper(f"{_ADMITTED} && response.code_details == 'stream_idle_timeout'", GatewayTimeout(
            f"The backend serving model `%DYNAMIC_METADATA({ROUTE_NAMESPACE}:model)%` sent nothing within the "
            "gateway's idle timeout, so the request was cut. Retry shortly.", headers=retry)),
        # Admitted (ext_proc set the route metadata), then every endpoint failed before answering.
        _mapper(f"{_ADMITTED} && {_NOT_OURS}", Unavailable(
            f"No endpoint of model `%DYNAMIC_METADATA({ROUTE_NAMESPACE}:model)%` could take the request. "
            "Retry shortly.", code="upstream_unavailable", headers=retry)),
        # The overload manager near listener.max_heap_bytes.
        _mapper("response.code_details == 'overload'", Unavailable(
            "The gateway is overloaded. Retry shortly.", code="gateway_overloaded", headers=retry)),
        # Headers or body too slow (listener.request_headers_timeout_seconds, request_timeout_seconds).
        _other(f"{_NOT_OURS} && response.code == 408", "invalid_request_error",
               "The request did not arrive in time.", "request_timeout"),
        # Anything else Envoy refuses by itself (a malformed request, a timeout): keep its status.
        _other(f"{_NOT_OURS} && response.code >= 500", "server_error",
               "The gateway could not complete the request. Retry shortly."),
        _other(_NOT_OURS, "invalid_request_error", "The gateway refused the request as malformed."),
    ]}


def _gateway_unavailable(headers: Mapping[str, str]) -> Rejection:
    return Unavailable("The gateway cannot check requests right now. Retry shortly.",
                       code="gateway_unavailable", headers=headers)


def _other(expression: str, error_type: str, message: str = "The gateway could not handle the request.",
           code: str = "gateway_error") -> dict[str, object]:
    rejection = Rejection(message, code=code)
    rejection.type = error_type
    mapper = _mapper(expression, rejection)
    del mapper["status_code"]  # Envoy's own status stands
    return mapper
