"""The ext_proc answers both protocol adapters send (extproc/, epp/): OpenAI-style JSON errors.

Below both adapters, so that neither imports the other. A `Rejection` becomes an ImmediateResponse
here (`rejection_response`: its status, `Rejection.body()` as JSON, its headers, details
`modeldock_<status>`, which the bootstrap's local_reply_config passes as it is); `GET /v1/models` is
answered here (`models_response`); `continue_other` is the empty answer for a phase an adapter does
not act on. What only the bootstrap gets (route metadata, Envoy's own replies) is extproc/responses.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2

from modeldock.errors import Rejection

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
            status=http_status_pb2.HttpStatus(code=status),
            headers=mutation,
            body=json.dumps(payload, separators=(",", ":")).encode(),
            details=f"modeldock_{status}",
        )
    )


def rejection_response(rejection: Rejection) -> ep.ProcessingResponse:
    return json_response(rejection.status, rejection.body(), rejection.headers)


def models_response(names: list[str]) -> ep.ProcessingResponse:
    """`GET /v1/models`, answered by ext_proc itself."""
    data = [{"id": name, "object": "model", "created": 0, "owned_by": "modeldock"} for name in names]
    return json_response(200, {"object": "list", "data": data})


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
        return ep.ProcessingResponse(response_headers=ep.HeadersResponse())
    if kind == "request_body":
        return ep.ProcessingResponse(request_body=ep.BodyResponse())
    return ep.ProcessingResponse(request_headers=ep.HeadersResponse())
