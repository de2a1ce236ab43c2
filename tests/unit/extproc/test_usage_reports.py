"""Reading Envoy's per-request usage log entries into UsageReports (extproc/attempts.py)."""

from __future__ import annotations

from modeldock.admission.tokens import Usage
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
