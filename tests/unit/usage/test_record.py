"""The usage record format: version 1, one JSON line, a lossless round trip."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from usage_helpers import BASE_TS, record

from modeldock.usage import FORMAT_VERSION, RecordError, UsageRecord, new_request_id
from modeldock.usage.record import MAX_CLIENT_ID, TERMINATIONS, parse_time, rfc3339


def test_line_has_every_documented_field_and_version_1() -> None:
    line = record(ts=BASE_TS + 0.25, client_request_id="abc", replica="gw-1", retries=2, cancelled=True,
                  cached_tokens=8, cost=0.0125, termination="client_disconnect", response_bytes=2048).to_json()
    data = json.loads(line)
    assert "\n" not in line
    assert data == {
        "v": 1, "time": "2023-11-14T22:13:20.250Z", "ts": BASE_TS + 0.25, "request_id": "r-1",
        "client_request_id": "abc", "replica": "gw-1", "tenant": "acme", "model": "llama-8b",
        "served_model": "meta-llama/Llama-3.1-8B-Instruct", "endpoint": "10.0.0.7:8000",
        "prompt_tokens": 12, "completion_tokens": 34, "cached_tokens": 8, "token_source": "reported",
        "cost": 0.0125, "status": 200, "cancelled": True, "termination": "client_disconnect",
        "response_bytes": 2048, "retries": 2,
    }
    assert FORMAT_VERSION == 1
    assert TERMINATIONS == {"completed", "client_disconnect", "upstream_error", "timeout", "rejected"}
    assert json.loads(record().to_json())["cost"] is None  # no price: null, not 0


def test_a_record_written_before_the_new_fields_reads_with_their_defaults() -> None:
    old = ('{"v":1,"time":"2023-11-14T22:13:20.000Z","ts":1700000000.0,"request_id":"r-1","client_request_id":"",'
           '"replica":"gw-1","tenant":"acme","model":"llama-8b","served_model":"meta-llama/Llama-3.1-8B-Instruct",'
           '"endpoint":"10.0.0.7:8000","prompt_tokens":12,"completion_tokens":34,"token_source":"reported",'
           '"status":200,"cancelled":false,"retries":0}')
    read = UsageRecord.from_json(old)
    assert (read.cached_tokens, read.cost, read.termination, read.response_bytes) == (0, None, "completed", 0)
    assert read == record(replica="gw-1")


_text = st.text(max_size=40)


@given(
    ts=st.floats(min_value=0, max_value=4_000_000_000, allow_nan=False).map(lambda t: round(t, 3)),
    tenant=_text, model=_text, served=_text, endpoint=_text, client=st.text(max_size=200),
    prompt=st.integers(0, 10**9), completion=st.integers(0, 10**9),
    source=st.sampled_from(["reported", "estimated"]), status=st.integers(0, 599),
    cancelled=st.booleans(), retries=st.integers(0, 10), cached=st.integers(0, 10**9),
    cost=st.none() | st.floats(min_value=0, max_value=1e6, allow_nan=False),
    termination=st.sampled_from(sorted(TERMINATIONS)), sent=st.integers(0, 10**12),
)
def test_round_trip_is_lossless_and_one_line(ts: float, tenant: str, model: str, served: str, endpoint: str,
                                            client: str, prompt: int, completion: int, source: str, status: int,
                                            cancelled: bool, retries: int, cached: int, cost: float | None,
                                            termination: str, sent: int) -> None:
    original = record(ts=ts, tenant=tenant, model=model, served_model=served, endpoint=endpoint,
                      client_request_id=client, prompt_tokens=prompt, completion_tokens=completion,
                      token_source=source, status=status, cancelled=cancelled, retries=retries,
                      cached_tokens=cached, cost=cost, termination=termination, response_bytes=sent)
    line = original.to_json()
    assert len(line.splitlines()) == 1  # a client's x-request-id with newlines cannot split a record
    assert UsageRecord.from_json(line) == original
    assert len(original.client_request_id) == min(len(client), MAX_CLIENT_ID)


def test_time_field_is_used_when_ts_is_absent_and_unknown_fields_are_ignored() -> None:
    data = json.loads(record().to_json())
    del data["ts"]
    data["later_field"] = "ignored within v1"
    assert UsageRecord.from_dict(data) == record()


@pytest.mark.parametrize("change, message", [
    ({"v": 2}, "unsupported usage record version 2"),
    ({"v": None}, "unsupported usage record version None"),
    ({"v": True}, "unsupported usage record version True"),
    ({"prompt_tokens": -1}, "prompt_tokens must be an integer from 0 to"),
    ({"completion_tokens": "5"}, "completion_tokens must be an integer from 0 to"),
    ({"status": True}, "status must be an integer from 0 to 999"),
    ({"status": 1000}, "status must be an integer from 0 to 999"),
    ({"prompt_tokens": 2**63}, "prompt_tokens must be an integer from 0 to 9223372036854775807"),
    ({"token_source": "guessed"}, "token_source 'guessed' is not one of"),
    ({"ts": "1700000000"}, "ts must be epoch seconds"),
    ({"ts": None}, "ts must be epoch seconds"),
    ({"ts": [1700000000]}, "ts must be epoch seconds"),
    ({"ts": float("nan")}, "ts must be epoch seconds"),
    ({"ts": float("inf")}, "ts must be epoch seconds"),
    ({"ts": -1}, "ts must be epoch seconds"),
    ({"ts": 10**400}, "ts must be epoch seconds"),
    ({"tenant": 7}, "tenant must be a string, got 7"),
    ({"tenant": None}, "tenant must be a string, got None"),
    ({"cancelled": "false"}, "cancelled must be true or false"),
    ({"cached_tokens": 1.5}, "cached_tokens must be an integer"),
    ({"response_bytes": -3}, "response_bytes must be an integer"),
    ({"cost": float("nan")}, "cost must be null or a non-negative number"),
    ({"cost": -0.5}, "cost must be null or a non-negative number"),
    ({"cost": "0.5"}, "cost must be null or a non-negative number"),
    ({"termination": "aborted"}, "termination 'aborted' is not one of"),
])
def test_bad_records_are_refused_with_the_reason(change: dict[str, object], message: str) -> None:
    data = json.loads(record().to_json()) | change
    with pytest.raises(RecordError, match=message):
        UsageRecord.from_dict(data)


@pytest.mark.parametrize("time_value, message", [
    ("yesterday", "'yesterday' is not an RFC 3339 time"),
    (None, "time must be an RFC 3339 string, got None"),
    (1700000000, "time must be an RFC 3339 string, got 1700000000"),
    ("0001-01-01T00:00:00+01:00", "out of range"),
    ("1969-12-31T23:59:59Z", "out of range"),
])
def test_a_bad_time_without_ts_is_refused(time_value: object, message: str) -> None:
    data = json.loads(record().to_json()) | {"time": time_value}
    del data["ts"]
    with pytest.raises(RecordError, match=message) as refused:
        UsageRecord.from_dict(data)
    assert refused.value.reason == "bad time"


def test_deeply_nested_json_is_refused_not_a_recursion_error() -> None:
    with pytest.raises(RecordError, match="nested too deeply") as refused:
        UsageRecord.from_json("[" * 100_000 + "]" * 100_000)
    assert refused.value.reason == "not JSON"


def test_missing_field_and_non_json_are_refused() -> None:
    data = json.loads(record().to_json())
    del data["tenant"]
    with pytest.raises(RecordError, match="lacks 'tenant'"):
        UsageRecord.from_dict(data)
    with pytest.raises(RecordError, match="not JSON"):
        UsageRecord.from_json(record().to_json()[:40])
    with pytest.raises(RecordError, match="not a JSON object"):
        UsageRecord.from_json("[1]")


def test_error_means_status_400_or_more_unless_cancelled_or_rejected() -> None:
    assert record(status=400).is_error and record(status=500).is_error and record(status=429).is_error
    assert not record(status=399).is_error and not record(status=200).is_error
    assert not record(status=499, cancelled=True).is_error
    rejected = record(status=429, termination="rejected", prompt_tokens=0, completion_tokens=0, endpoint="")
    assert rejected.is_rejected and not rejected.is_error
    assert not record(status=502, termination="upstream_error").is_rejected


def test_time_formats() -> None:
    assert rfc3339(BASE_TS + 0.9996) == "2023-11-14T22:13:21.000Z"
    assert parse_time("2023-11-14T22:13:20Z") == BASE_TS
    assert parse_time("2023-11-14T23:13:20+01:00") == BASE_TS
    assert parse_time("2023-11-14T22:13:20") == BASE_TS  # no offset: UTC
    assert parse_time("2023-11-14") == BASE_TS - (22 * 3600 + 13 * 60 + 20)
    with pytest.raises(ValueError, match="not an RFC 3339 time"):
        parse_time("yesterday")
    ids = {new_request_id() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 32 for i in ids)
