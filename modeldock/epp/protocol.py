"""The Endpoint Picker protocol's names and ProcessingResponse builders (GIE proposal 004).

Only protobuf lives here and in flow.py; the decisions are the director's (modeldock/gateway/).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from modeldock.epp.strip import STRIPPED_HEADERS, STRIPPED_PREFIXES
from modeldock.types import Endpoint
from modeldock.xds.resources import DESTINATION_HEADER, LB_NAMESPACE

SUBSET_KEY = "x-gateway-destination-endpoint-subset"  # envoy.lb metadata from the gateway: pick only among these
SERVED_KEY = "x-gateway-destination-endpoint-served"  # envoy.lb metadata from the gateway: who answered
# The health services the gateways (and GIE's charts) probe, besides the overall status "".
HEALTH_SERVICES = ("envoy.service.ext_proc.v3.ExternalProcessor", "liveness", "readiness")
# What the client sent that no upstream may see: the list both modes strip (strip.py), and the
# protocol's own routing keys (the gateway's metadata names; a client's header of that name goes no further).
CLIENT_HEADERS = (*STRIPPED_HEADERS, SUBSET_KEY, SERVED_KEY)
# A streamed body goes back in chunks of at most this size (each is one gRPC message).
CHUNK_BYTES = 64 * 1024

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_pairs(headers: ep.HttpHeaders) -> list[tuple[str, str]]:
    """(name, value) of a headers message; Envoy sends raw_value (bytes), older senders value."""
    return [(h.key, h.raw_value.decode("utf-8", "surrogateescape") if h.raw_value else h.value)
            for h in headers.headers.headers]


def _set(mutation: ep.HeaderMutation, key: str, value: str) -> None:
    mutation.set_headers.append(base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE))


def request_mutation(common: ep.CommonResponse, destination: str, content_length: int,
                     present: Iterable[str], upstream_auth: tuple[str, str] | None) -> None:
    """Route the request: the destination header (overwriting any the client sent), the length of the
    body that goes on, the model's backend credential, and the client's credential and routing headers
    removed. `present`: the request's header names (lower case), for the x-modeldock-* prefix."""
    mutation = common.header_mutation
    _set(mutation, DESTINATION_HEADER, destination)
    _set(mutation, "content-length", str(content_length))
    keep = ""
    if upstream_auth is not None:
        keep = upstream_auth[0]
        _set(mutation, upstream_auth[0], upstream_auth[1])
    removed = [h for h in CLIENT_HEADERS if h != DESTINATION_HEADER and h != keep]
    removed.extend(h for h in present if h.startswith(STRIPPED_PREFIXES) and h != keep)
    mutation.remove_headers.extend(removed)
    common.clear_route_cache = True


def destination_metadata(response: ep.ProcessingResponse, destination: str) -> None:
    """envoy.lb / x-gateway-destination-endpoint, the same value as the header (the protocol wants both)."""
    response.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = destination


def routed_headers(destination: str, content_length: int, present: Iterable[str],
                   upstream_auth: tuple[str, str] | None) -> ep.ProcessingResponse:
    """FULL_DUPLEX_STREAMED: the request-headers answer, sent once the whole body is in."""
    response = ep.ProcessingResponse()
    request_mutation(response.request_headers.response, destination, content_length, present, upstream_auth)
    destination_metadata(response, destination)
    return response


def routed_body(destination: str, body: bytes | None, content_length: int, present: Iterable[str],
                upstream_auth: tuple[str, str] | None) -> ep.ProcessingResponse:
    """BUFFERED: the body answer routes (the headers are held until it is in); `body`: a rewrite or None."""
    response = ep.ProcessingResponse()
    common = response.request_body.response
    request_mutation(common, destination, content_length, present, upstream_auth)
    if body is not None:
        common.body_mutation.body = body
    destination_metadata(response, destination)
    return response


def streamed_chunks(kind: str, body: bytes, end_of_stream: bool) -> list[ep.ProcessingResponse]:
    """`body` as FULL_DUPLEX_STREAMED body answers (`kind`: request_body or response_body); an empty
    body still gives one message, which carries the end of the stream."""
    pieces = [body[i:i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    out = []
    for i, piece in enumerate(pieces):
        response = ep.ProcessingResponse()
        streamed = getattr(response, kind).response.body_mutation.streamed_response
        streamed.body = piece
        streamed.end_of_stream = end_of_stream and i == len(pieces) - 1
        out.append(response)
    return out


def echo_chunk(kind: str, body: bytes, end_of_stream: bool) -> ep.ProcessingResponse:
    """One FULL_DUPLEX_STREAMED chunk passed on unchanged (hot: every response chunk comes here)."""
    response = ep.ProcessingResponse()
    streamed = getattr(response, kind).response.body_mutation.streamed_response
    streamed.body = body
    streamed.end_of_stream = end_of_stream
    return response


def response_headers(headers: Mapping[str, str]) -> ep.ProcessingResponse:
    """The response-headers answer: the x-ratelimit-* set added; nothing says what serves the API."""
    response = ep.ProcessingResponse()
    mutation = response.response_headers.response.header_mutation
    for key, value in headers.items():
        _set(mutation, key.lower(), value)
    mutation.remove_headers.append("server")
    return response


def lb_value(request: ep.ProcessingRequest, key: str) -> struct_pb2.Value | None:
    """The gateway's envoy.lb metadata entry `key` forwarded on this message, if any."""
    lb = request.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if lb is None or key not in lb.fields:
        return None
    value: struct_pb2.Value = lb.fields[key]
    return value


def subset_endpoints(value: struct_pb2.Value) -> frozenset[Endpoint]:
    """A subset hint: a list of "ip:port" (or one comma-separated string); what does not parse is left out."""
    kind = value.WhichOneof("kind")
    texts: list[str] = []
    if kind == "list_value":
        texts = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    elif kind == "string_value":
        texts = value.string_value.split(",")
    found = set()
    for text in texts:
        try:
            found.add(Endpoint.parse(text))
        except ValueError:
            continue
    return frozenset(found)


def served_address(value: struct_pb2.Value) -> str:
    """The served-endpoint report: "ip:port" (the first, should a list come)."""
    return value.string_value.split(",", 1)[0].strip() if value.WhichOneof("kind") == "string_value" else ""
