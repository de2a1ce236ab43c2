"""ext_proc reads requests whose attribute strings are not UTF-8 (upb alone refuses them)."""

from __future__ import annotations

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import message
from hypothesis import given
from hypothesis import strategies as st

from modeldock.extproc.wire import parse_request
from tests.unit.extproc.flow_fuzz_setup import FUZZ, all_strings, corrupt, corruptions, decoded
from tests.unit.extproc.flow_fuzz_strategies import plausible_messages, random_message


@FUZZ
@given(data=st.data(), msg=st.one_of(random_message, plausible_messages.map(lambda m: m[0])))
def test_parse_request_reads_invalid_utf8_attributes(data: st.DataObject, msg: ep.ProcessingRequest) -> None:
    """upb rejects a ProcessingRequest whose attribute string is not UTF-8; `parse_request` reads it, with
    replacement characters in those strings and everything else as sent."""
    raw = msg.SerializeToString()
    assert parse_request(raw) == msg
    junk = data.draw(corruptions(msg))
    if not junk:
        return
    raw = corrupt(msg, junk)
    with pytest.raises(message.DecodeError):
        ep.ProcessingRequest.FromString(raw)
    got = parse_request(raw)
    want = decoded(msg, junk)
    rest_got, rest_want = ep.ProcessingRequest(), ep.ProcessingRequest()
    rest_got.CopyFrom(got)
    rest_want.CopyFrom(want)
    rest_got.ClearField("attributes")
    rest_want.ClearField("attributes")
    assert rest_got == rest_want  # everything but the attributes, as sent
    assert set(got.attributes) == set(want.attributes)
    for ns, struct in want.attributes.items():
        assert set(got.attributes[ns].fields) == set(struct.fields)
        for name, value in struct.fields.items():
            if value.WhichOneof("kind") == "string_value":
                assert got.attributes[ns].fields[name].string_value == value.string_value, (ns, name)
    if all_strings(msg):
        assert got == want
