"""The usage records a stack's ext_proc replicas wrote (usage*.jsonl in the usage directory), for e2e tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from modeldock.devstack.stack import wait_until
from modeldock.usage.record import UsageRecord


def read_usage_records(usage_dir: Path, pattern: str = "usage*.jsonl") -> list[UsageRecord]:
    """Every record in the files matching `pattern`, file by file in name order."""
    found: list[UsageRecord] = []
    for path in sorted(usage_dir.glob(pattern)):
        found += [UsageRecord.from_json(line) for line in path.read_text().splitlines() if line.strip()]
    return found


def wait_for_usage_record(read: Callable[[], list[UsageRecord]], client_id: str, timeout: float = 10) -> UsageRecord:
    """The one record of the request the client sent as `client_id`, once `read` returns it (at most `timeout` s)."""
    matches: list[UsageRecord] = []

    def found() -> bool:
        matches[:] = [r for r in read() if r.client_request_id == client_id]
        return bool(matches)

    wait_until(found, timeout, what=f"the usage record of {client_id}")
    assert len(matches) == 1, matches
    return matches[0]
