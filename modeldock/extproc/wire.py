"""Decode what Envoy sends, even when an attribute is not valid UTF-8.

Envoy copies request headers into `request_attributes` as protobuf strings, bytes
and all; upb then refuses the whole ProcessingRequest ("String field had bad
UTF-8") and grpc aborts the stream. This decoder falls back to a look-alike
message whose attribute strings are bytes, decodes them with replacement
characters (so a mangled API key is simply an unknown key), and parses the rest
as usual. The fallback runs only for such requests.
"""

from __future__ import annotations

from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

_F = descriptor_pb2.FieldDescriptorProto
_ATTRIBUTES_FIELD = ep.ProcessingRequest.DESCRIPTOR.fields_by_name["attributes"].number


def _map_entry(name: str, value_type: int, value_type_name: str = "") -> descriptor_pb2.DescriptorProto:
    entry = descriptor_pb2.DescriptorProto(name=name, options=descriptor_pb2.MessageOptions(map_entry=True))
    entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=value_type, type_name=value_type_name, label=_F.LABEL_OPTIONAL)
    return entry


def _lenient_type() -> type[message.Message]:
    """attributes: map<string, Struct>, with each Value's string_value read as bytes."""
    f = descriptor_pb2.FileDescriptorProto(name="modeldock/lenient_attributes.proto", package="modeldock.lenient",
                                           syntax="proto3")
    value = f.message_type.add(name="Value")
    value.field.add(name="string_value", number=3, type=_F.TYPE_BYTES, label=_F.LABEL_OPTIONAL)
    struct = f.message_type.add(name="Struct")
    struct.nested_type.append(_map_entry("FieldsEntry", _F.TYPE_MESSAGE, ".modeldock.lenient.Value"))
    struct.field.add(name="fields", number=1, type=_F.TYPE_MESSAGE, label=_F.LABEL_REPEATED,
                     type_name=".modeldock.lenient.Struct.FieldsEntry")
    request = f.message_type.add(name="Request")
    request.nested_type.append(_map_entry("AttributesEntry", _F.TYPE_MESSAGE, ".modeldock.lenient.Struct"))
    request.field.add(name="attributes", number=_ATTRIBUTES_FIELD, type=_F.TYPE_MESSAGE, label=_F.LABEL_REPEATED,
                      type_name=".modeldock.lenient.Request.AttributesEntry")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("modeldock.lenient.Request"))


_Lenient = _lenient_type()


def parse_request(data: bytes) -> ep.ProcessingRequest:
    try:
        return ep.ProcessingRequest.FromString(data)
    except message.DecodeError:
        pass
    # A message class built at import time: the protobuf stubs cannot type its fields.
    lenient: Any = _Lenient.FromString(data)  # every other field is kept as an unknown field
    attributes = {ns: {k: v.string_value.decode("utf-8", "replace") for k, v in struct.fields.items()}
                  for ns, struct in lenient.attributes.items()}
    lenient.ClearField("attributes")
    request = ep.ProcessingRequest.FromString(lenient.SerializeToString())
    for ns, values in attributes.items():
        request.attributes[ns].update(values)
    return request


def add_servicer(servicer: ep_grpc.ExternalProcessorServicer, server: grpc.aio.Server) -> None:
    """Like the generated add_ExternalProcessorServicer_to_server, with `parse_request`."""
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.Process, request_deserializer=parse_request,
        response_serializer=ep.ProcessingResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "envoy.service.ext_proc.v3.ExternalProcessor", {"Process": handler}),))
