"""The usage file writer: whole lines, rotation, bounded files, a clear error at start, kill-safety."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from usage_helpers import record

from modeldock.clock import FakeClock
from modeldock.usage import FileSink, StdoutSink, UsageConfig, UsageLog, UsageSinkError
from modeldock.usage.summary import ReadStats, read_records

REPO = Path(__file__).resolve().parents[3]


def config(tmp_path: Path, **overrides: object) -> UsageConfig:
    fields: dict[str, object] = {"path": tmp_path / "usage.jsonl", "replica": "gw-1"}
    fields.update(overrides)
    return UsageConfig.model_validate(fields)


def lines_of(path: Path) -> list[dict[str, object]]:
    raw = path.read_bytes()
    assert not raw or raw.endswith(b"\n"), f"{path} ends mid-line"  # empty: killed just after a rotation
    return [json.loads(line) for line in raw.splitlines()]


def test_one_line_per_record_in_the_replica_file_and_replica_filled_in(tmp_path: Path) -> None:
    clock = FakeClock()
    usage = UsageLog.open(config(tmp_path), clock, background=False)
    for i in range(5):
        usage.emit(record(request_id=f"r-{i}", ts=clock.time()))
    usage.close()
    usage.close()  # twice is harmless
    active = tmp_path / "usage.gw-1.jsonl"
    assert os.listdir(tmp_path) == [active.name]
    rows = lines_of(active)
    assert [r["request_id"] for r in rows] == [f"r-{i}" for i in range(5)]
    assert {r["replica"] for r in rows} == {"gw-1"}


def test_size_rotation_keeps_whole_lines_and_at_most_max_files(tmp_path: Path) -> None:
    clock = FakeClock()
    sink = FileSink(config(tmp_path, max_file_bytes=4096, max_files=3), clock, background=False)
    usage = UsageLog(sink, UsageLog.open(None, clock).metrics, clock, "gw-1")
    line_bytes = len(record(request_id="r-0000", replica="gw-1").to_json()) + 1
    total = 200
    for i in range(total):
        usage.emit(record(request_id=f"r-{i:04d}", ts=clock.time()))
        clock.advance(0.001)
    sink.sync()  # the background thread's work: close rotated files, prune
    names = sorted(os.listdir(tmp_path))
    rotated = [n for n in names if n != "usage.gw-1.jsonl"]
    assert len(rotated) == 3 and "usage.gw-1.jsonl" in names
    assert all(n.startswith("usage.gw-1.2023") and n.endswith("Z.jsonl") for n in rotated)
    ids: list[str] = []
    for name in [*rotated, "usage.gw-1.jsonl"]:  # rotated names sort oldest first
        size = (tmp_path / name).stat().st_size
        assert size <= 4096
        if name != "usage.gw-1.jsonl":
            assert size > 4096 - line_bytes  # rotated only when the next line would not fit
        ids += [str(r["request_id"]) for r in lines_of(tmp_path / name)]
    # The kept files hold the newest records, in order, none split or repeated.
    assert ids == [f"r-{i:04d}" for i in range(total - len(ids), total)]
    assert len(ids) > 3 * (4096 // line_bytes)
    sink.close()


def test_daily_rotation_at_midnight_utc(tmp_path: Path) -> None:
    clock = FakeClock()  # 2023-11-14T22:13:20Z
    sink = FileSink(config(tmp_path), clock, background=False)
    usage = UsageLog(sink, UsageLog.open(None, clock).metrics, clock, "gw-1")
    usage.emit(record(request_id="day-1", ts=clock.time()))
    clock.advance(6399)  # 23:59:59
    usage.emit(record(request_id="day-1-late", ts=clock.time()))
    clock.advance(2)  # 00:00:01 the next day
    usage.emit(record(request_id="day-2", ts=clock.time()))
    usage.close()
    rotated = sorted(n for n in os.listdir(tmp_path) if n != "usage.gw-1.jsonl")
    assert rotated == ["usage.gw-1.20231115T000001000000Z.jsonl"]
    assert [r["request_id"] for r in lines_of(tmp_path / rotated[0])] == ["day-1", "day-1-late"]
    assert [r["request_id"] for r in lines_of(tmp_path / "usage.gw-1.jsonl")] == ["day-2"]


def test_a_torn_last_line_from_a_crash_stays_alone(tmp_path: Path) -> None:
    active = tmp_path / "usage.gw-1.jsonl"
    good = record(request_id="before").to_json()
    active.write_text(good + "\n" + good[:50])
    clock = FakeClock(wall=time.time())  # the file's mtime is today: no daily rotation
    usage = UsageLog.open(config(tmp_path), clock, background=False)
    usage.emit(record(request_id="after"))
    usage.close()
    stats = ReadStats()
    assert [r.request_id for r in read_records([active], stats)] == ["before", "after"]
    assert stats.unreadable == 1


def test_unwritable_location_fails_at_start_with_the_path_and_a_hint(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(UsageSinkError) as failure:
        UsageLog.open(config(tmp_path, path=blocker / "usage.jsonl"), FakeClock())
    message = str(failure.value)
    assert message.startswith(f"usage.path: cannot write usage records to {blocker / 'usage.gw-1.jsonl'}")
    assert "usage.stdout: true" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_read_only_directory_fails_at_start(tmp_path: Path) -> None:
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(UsageSinkError, match="not writable"):
            UsageLog.open(config(tmp_path), FakeClock())
    finally:
        tmp_path.chmod(0o700)


def test_active_file_that_cannot_be_opened_fails_at_start_even_as_root(tmp_path: Path) -> None:
    (tmp_path / "usage.gw-1.jsonl").mkdir()  # open(O_WRONLY) of a directory fails for root too
    with pytest.raises(UsageSinkError) as failure:
        UsageLog.open(config(tmp_path), FakeClock())
    assert str(failure.value).startswith(
        f"usage.path: cannot write usage records to {tmp_path / 'usage.gw-1.jsonl'}: [Errno 21] Is a directory")


def test_directory_without_write_permission_fails_at_start_even_as_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Root may write any directory, so the permission a read-only mount or another owner denies is faked:
    # the writer must ask for write access to the directory (rotation creates files there), not only the file.
    (tmp_path / "usage.gw-1.jsonl").write_text("")  # the file itself exists and is writable
    real_access = os.access

    def access(path: object, mode: int) -> bool:
        return False if Path(str(path)) == tmp_path and mode & os.W_OK else real_access(path, mode)  # type: ignore[arg-type]

    monkeypatch.setattr("modeldock.usage.writer.os.access", access)
    with pytest.raises(UsageSinkError, match=f"directory {tmp_path} is not writable"):
        UsageLog.open(config(tmp_path), FakeClock())


def test_fsync_every_n_records_wakes_the_background_thread(tmp_path: Path) -> None:
    sink = FileSink(config(tmp_path, fsync_interval_seconds=60, fsync_every_records=3), FakeClock())
    try:
        for i in range(2):
            sink.write((record(request_id=str(i)).to_json() + "\n").encode())
        time.sleep(0.05)
        assert sink.synced_records == 0  # under N and long before the timer
        sink.write((record(request_id="2").to_json() + "\n").encode())
        deadline = time.monotonic() + 5
        while sink.synced_records < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sink.synced_records == 3
    finally:
        sink.close()


def test_a_failed_write_loses_the_record_counts_it_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    clock = FakeClock()
    fd = os.open("/dev/full", os.O_WRONLY)
    try:
        usage = UsageLog(StdoutSink(fd), UsageLog.open(None, clock, registry).metrics, clock, "gw-1")
        with caplog.at_level(logging.ERROR, logger="modeldock.usage.log"):
            usage.emit(record(request_id="lost-1"))
            usage.emit(record(request_id="lost-2"))  # within a minute: counted, not logged again
    finally:
        os.close(fd)
    assert usage.lost == 2
    assert registry.get_sample_value("modeldock_usage_write_errors_total") == 2
    assert registry.get_sample_value("modeldock_usage_records_total") == 0
    # The tokens were used all the same.
    assert registry.get_sample_value("modeldock_tokens_total",
                                     {"tenant": "acme", "model": "llama-8b", "kind": "prompt"}) == 24
    assert [r.getMessage()[:28] for r in caplog.records] == ["usage: record lost-1 lost, c"]


def test_no_config_means_metrics_only() -> None:
    registry = CollectorRegistry()
    usage = UsageLog.open(None, FakeClock(), registry)
    usage.emit(record())
    usage.close()
    assert usage.sink is None
    assert registry.get_sample_value("modeldock_tokens_total",
                                     {"tenant": "acme", "model": "llama-8b", "kind": "completion"}) == 34


CHILD = """
import sys
from pathlib import Path
from modeldock.clock import SystemClock
from modeldock.usage import UsageConfig, UsageLog, UsageRecord
limit = int(sys.argv[2])
# No fsync for a minute and small files: only the kernel's page cache and rotation stand between
# write(2) and the file.
config = UsageConfig(path=Path(sys.argv[1]) / "usage.jsonl", replica="child", fsync_interval_seconds=60,
                     max_file_bytes=16384, max_files=10000)
usage = UsageLog.open(config, SystemClock())
i = 0
while limit == 0 or i < limit:
    usage.emit(UsageRecord(ts=1.0, request_id=str(i), tenant="acme", model="m", served_model="m",
                           endpoint="127.0.0.1:1", prompt_tokens=i, completion_tokens=1,
                           token_source="reported", status=200))
    i += 1
    print(i, flush=True)  # acknowledged: the request was answered
print("done", flush=True)
sys.stdin.read()
"""


def _records_on_disk(directory: Path) -> list[int]:
    ids: list[int] = []
    for name in sorted(os.listdir(directory)):  # rotated (oldest first), then the active file
        if name != "usage.child.jsonl":
            ids += [int(str(r["request_id"])) for r in lines_of(directory / name)]
    return ids + [int(str(r["request_id"])) for r in lines_of(directory / "usage.child.jsonl")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("limit", [500, 0], ids=["killed-after-N", "killed-mid-stream"])
def test_sigkill_loses_no_answered_record(tmp_path: Path, limit: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(limit)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    acked = 0
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line == "done\n":
                break
            acked = int(line)  # counted before stopping: a line read and dropped would be a record unacknowledged
            if acked >= 3000:
                break
        child.send_signal(signal.SIGKILL)
        rest = child.stdout.read()  # the acknowledgements still in the pipe or the reader's buffer
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
        for pipe in (child.stdin, child.stdout):
            if pipe is not None:
                pipe.close()
    assert child.returncode == -signal.SIGKILL
    acked = max([acked, *(int(n) for n in rest.split() if n.isdigit())])
    ids = _records_on_disk(tmp_path)  # every line complete (lines_of checks the last byte)
    assert acked >= (limit or 3000)
    assert ids[:acked] == list(range(acked))  # every answered record, in order
    assert len(ids) - acked <= 1  # at most the one written but not yet acknowledged
    if limit:
        assert len(ids) == limit
    assert len(os.listdir(tmp_path)) > 2  # the kill test crossed rotations


def test_a_file_left_from_an_earlier_day_is_rotated_by_the_first_record(tmp_path: Path) -> None:
    clock = FakeClock()
    active = tmp_path / "usage.gw-1.jsonl"
    active.write_text(record(request_id="old", ts=clock.time() - 86400).to_json() + "\n")
    os.utime(active, (clock.time() - 86400, clock.time() - 86400))
    usage = UsageLog.open(config(tmp_path), clock, background=False)
    usage.emit(record(request_id="new", ts=clock.time()))
    usage.close()
    rotated = [n for n in os.listdir(tmp_path) if n != active.name]
    assert len(rotated) == 1
    assert [r["request_id"] for r in lines_of(tmp_path / rotated[0])] == ["old"]
    assert [r["request_id"] for r in lines_of(active)] == ["new"]


def test_config_names_the_replica_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELDOCK_REPLICA", "gw.example:7f9c")
    cfg = UsageConfig(path=tmp_path / "usage.jsonl")
    assert cfg.replica_id() == "gw-example-7f9c"  # sanitised: no dots, so file names stay unambiguous
    assert cfg.active_path() == tmp_path / "usage.gw-example-7f9c.jsonl"
    assert config(tmp_path).active_path() == tmp_path / "usage.gw-1.jsonl"
    with pytest.raises(ValueError, match="replica"):
        config(tmp_path, replica="a.b")
    with pytest.raises(ValueError, match="max_file_bytes"):
        config(tmp_path, max_file_bytes=10)
    with pytest.raises(ValueError, match="path"):
        config(tmp_path, path="/")


def test_a_failed_rotation_keeps_appending_to_the_active_file(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    sink = FileSink(config(tmp_path, max_file_bytes=4096), clock, background=False)
    line = (record(request_id="x" * 3000).to_json() + "\n").encode()
    sink.write(line)
    attempts: list[str] = []

    def refuse(src: object, dst: object) -> None:
        attempts.append(str(dst))
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "rename", refuse)  # a read-only directory, even for root
    sink.write(line)
    sink.write(line)  # no new attempt within a minute
    monkeypatch.undo()
    assert len(attempts) == 1
    clock.advance(61)
    sink.write(line)  # rotates now
    sink.close()
    active = tmp_path / "usage.gw-1.jsonl"
    assert len(lines_of(active)) == 1
    rotated = [n for n in os.listdir(tmp_path) if n != active.name]
    assert len(rotated) == 1 and len(lines_of(tmp_path / rotated[0])) == 3
