"""Reading Envoy's per-request usage log entries into UsageReports (extproc/attempts.py)."""

from __future__ import annotations

import pytest
from envoy.service.accesslog.v3 import als_pb2

from modeldock.budgets.tokens import Usage
from modeldock.extproc.attempts import usage_reports
from modeldock.gateway.settlement import UsageReport
from tests.support.extproc_messages import usage_log_entry, usage_log_message


def test_a_completed_request_reports_its_usage_endpoint_and_attempts() -> None:
    msg = usage_log_message()
    usage_log_entry(msg, rid="ab-1", usage={"prompt_tokens": 12, "completion_tokens": 30},
                    endpoint="10.0.0.2:8000", attempts=2)
    assert usage_reports(msg) == [UsageReport("ab-1", Usage(12, 30), True, 200, False, "10.0.0.2:8000", 2)]


def test_no_usage_a_cut_stream_and_a_request_no_backend_answered() -> None:
    msg = usage_log_message()
    usage_log_entry(msg, rid="cut", cancelled=True)
    usage_log_entry(msg, rid="never", status=503, upstream_header_bytes=0)
    cut, never = usage_reports(msg)
    assert cut.usage is None and cut.reached_backend and cut.cancelled
    assert never.usage is None and not never.reached_backend and never.status == 503


def test_entries_without_a_gateway_key_or_with_bad_usage() -> None:
    msg = usage_log_message()
    usage_log_entry(msg, rid=None, usage={"prompt_tokens": 1, "completion_tokens": 1})
    usage_log_entry(msg, rid="half", usage={"prompt_tokens": 3})  # one count missing: not usage
    usage_log_entry(msg, rid="neg", usage={"prompt_tokens": -1, "completion_tokens": 2})
    usage_log_entry(msg, rid="text", usage={"prompt_tokens": "3", "completion_tokens": 2})
    reports = usage_reports(msg)
    assert [r.rid for r in reports] == ["half", "neg", "text"]
    assert all(r.usage is None for r in reports)


def test_the_rid_header_stands_in_when_the_metadata_has_none() -> None:
    msg = usage_log_message()
    usage_log_entry(msg, rid=None, usage={"prompt_tokens": 2, "completion_tokens": 5})
    msg.http_logs.log_entry[0].request.request_headers["x-modeldock-rid"] = "from-header"
    (report,) = usage_reports(msg)
    assert report.rid == "from-header" and report.usage == Usage(2, 5)


def _entry(msg: als_pb2.StreamAccessLogsMessage, rid: str, *, status: int = 200, header_bytes: int = 120,
           wire_sent: int = 190, details: str = "via_upstream", flags: tuple[str, ...] = (),
           body_bytes: int = 0) -> None:
    """An entry with the fields Envoy 1.40 fills for each outcome (tests/e2e/test_request_outcomes.py)."""
    usage_log_entry(msg, rid=rid, status=status, upstream_header_bytes=header_bytes)
    entry = msg.http_logs.log_entry[-1]
    entry.common_properties.upstream_wire_bytes_sent = wire_sent
    entry.response.response_code_details = details
    entry.response.response_body_bytes = body_bytes
    for flag in flags:
        setattr(entry.common_properties.response_flags, flag, True)


def test_a_body_that_reached_a_backend_before_any_header_came_back_is_sent() -> None:
    # vLLM sends a non-streaming reply's headers after generating: the client left before them.
    msg = usage_log_message()
    _entry(msg, "left", status=0, header_bytes=0, details="downstream_remote_disconnect",
           flags=("downstream_connection_termination",))
    _entry(msg, "refused", status=503, header_bytes=0, wire_sent=0, body_bytes=153,
           details="upstream_reset_before_response_started{remote_connection_failure}",
           flags=("upstream_connection_failure", "upstream_retry_limit_exceeded"))
    left, refused = usage_reports(msg)
    assert left.sent and not left.reached_backend and left.cancelled
    assert not (left.upstream_failed or left.timed_out or left.backend_error)
    assert not refused.sent and refused.upstream_failed and not refused.backend_error
    assert refused.response_bytes == 153


def test_a_backends_own_error_is_told_from_envoys() -> None:
    msg = usage_log_message()
    _entry(msg, "500", status=500, body_bytes=13)
    _entry(msg, "503-retried", status=503, flags=("upstream_retry_limit_exceeded",))  # every attempt said 503
    _entry(msg, "400", status=400)
    _entry(msg, "ok", status=200)
    _entry(msg, "envoy-503", status=503, details="upstream_reset_before_response_started{connection_termination}",
           flags=("upstream_connection_termination",))
    reports = {r.rid: r for r in usage_reports(msg)}
    assert [rid for rid, r in reports.items() if r.backend_error] == ["500", "503-retried", "400"]
    assert reports["500"].response_bytes == 13 and not reports["500"].upstream_failed
    assert reports["envoy-503"].upstream_failed


@pytest.mark.parametrize("flag", ["upstream_request_timeout", "stream_idle_timeout", "duration_timeout",
                                  "upstream_max_stream_duration_reached"])
def test_each_of_envoys_timeouts_is_a_timeout(flag: str) -> None:
    msg = usage_log_message()
    _entry(msg, "t", status=504, header_bytes=0, details="stream_idle_timeout", flags=(flag,))
    (report,) = usage_reports(msg)
    assert report.timed_out and not report.upstream_failed and not report.backend_error and report.sent


@pytest.mark.parametrize("flag", ["upstream_remote_reset", "upstream_connection_failure",
                                  "upstream_connection_termination", "upstream_overflow", "no_healthy_upstream",
                                  "upstream_protocol_error", "no_cluster_found", "dns_resolution_failure"])
def test_each_upstream_failure_is_an_upstream_failure(flag: str) -> None:
    msg = usage_log_message()
    # A stream cut after its 200 started (UPE) logs status 200: still a failure, not a backend error.
    _entry(msg, "f", status=200, details="upstream_reset_after_response_started{protocol_error}", flags=(flag,),
           body_bytes=29)
    (report,) = usage_reports(msg)
    assert report.upstream_failed and not report.timed_out and not report.backend_error
    assert report.response_bytes == 29


def test_a_client_gone_after_a_backend_error_started_is_not_a_backend_error() -> None:
    msg = usage_log_message()
    _entry(msg, "gone", status=500, flags=("downstream_connection_termination",))
    (report,) = usage_reports(msg)
    assert report.cancelled and not report.backend_error


def test_cached_tokens_are_read_from_the_usage_metadata() -> None:
    msg = usage_log_message()
    usage_log_entry(msg, rid="c", usage={"prompt_tokens": 12, "completion_tokens": 3, "cached_tokens": 8})
    usage_log_entry(msg, rid="none", usage={"prompt_tokens": 12, "completion_tokens": 3})
    cached, none = usage_reports(msg)
    assert cached.usage == Usage(12, 3, 8) and none.usage == Usage(12, 3, 0)


def test_a_report_that_reached_a_backend_was_sent() -> None:
    assert UsageReport("r", None, True).sent
    assert not UsageReport("r", None, False).sent
    assert UsageReport("r", None, False, sent=True).sent
