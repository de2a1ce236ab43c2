"""Build ext_proc ProcessingResponses; `rejection_response` is the one place a
Rejection becomes an Envoy ImmediateResponse."""

from __future__ import annotations

import json
from collections.abc import Mapping

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2

from modeldock.errors import Rejection
from modeldock.xds.resources import DESTINATION_HEADER, LB_NAMESPACE, ROUTE_NAMESPACE

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def json_response(status: int, payload: object, headers: Mapping[str, str] | None = None) -> ep.ProcessingResponse:
    mutation = ep.HeaderMutation(set_headers=[_header("content-type", "application/json")])
    for key, value in (headers or {}).items():
        mutation.set_headers.append(_header(key.lower(), value))
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),  # type: ignore[arg-type]
            headers=mutation,
            body=json.dumps(payload, separators=(",", ":")).encode(),
            details=f"modeldock_{status}",
        )
    )


def rejection_response(rejection: Rejection) -> ep.ProcessingResponse:
    return json_response(rejection.status, rejection.body(), rejection.headers)


def header_mutation(set_headers: Mapping[str, str]) -> ep.HeaderMutation:
    return ep.HeaderMutation(set_headers=[_header(k, v) for k, v in set_headers.items()])


def route_request_body(cluster: str, endpoints: str, body: bytes | None = None) -> ep.ProcessingResponse:
    """Send the request on: the cluster and endpoint list go to Envoy as dynamic metadata.

    With the header phase skipped, a body response cannot change request headers
    (Envoy ignores the mutation), but it must carry one for `clear_route_cache` to
    take effect, so that the route is matched again with the metadata present.
    """
    response = ep.ProcessingResponse()
    common = response.request_body.response
    common.clear_route_cache = True
    common.header_mutation.SetInParent()
    # Filled field by field: Struct.update is several times slower.
    fields = response.dynamic_metadata.fields
    route = fields[ROUTE_NAMESPACE].struct_value.fields
    route["cluster"].string_value = cluster
    if body is not None:
        common.body_mutation.body = body
        route["content_length"].string_value = str(len(body))
    fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = endpoints
    return response


def continue_response_headers(mutation: ep.HeaderMutation | None = None) -> ep.ProcessingResponse:
    common = ep.CommonResponse(header_mutation=mutation) if mutation else ep.CommonResponse()
    return ep.ProcessingResponse(response_headers=ep.HeadersResponse(response=common))


def continue_other(request: ep.ProcessingRequest) -> ep.ProcessingResponse:
    """An empty answer of the matching kind, for phases modeldock does not act on."""
    kind = request.WhichOneof("request")
    if kind == "response_body":
        return ep.ProcessingResponse(response_body=ep.BodyResponse())
    if kind == "request_trailers":
        return ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
    if kind == "response_trailers":
        return ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
    if kind == "response_headers":
        return continue_response_headers()
    if kind == "request_body":
        return ep.ProcessingResponse(request_body=ep.BodyResponse())
    return ep.ProcessingResponse(request_headers=ep.HeadersResponse())
