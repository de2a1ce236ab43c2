"""Append usage records to a file, one `write(2)` per record, from the event loop.

Durability, by failure:
- ext_proc killed (SIGKILL, OOM, crash): nothing that `write` returned from is lost. The
  file is opened O_APPEND and each record is one write(2) of a whole line, so the bytes
  are in the kernel's page cache before the request's settle step returns.
- the machine dies (power, kernel panic): records written since the last fsync are lost,
  i.e. at most `fsync_interval_seconds` of them (and, with `fsync_every_records` = N, at
  most N-1 more than were fsynced). A torn last line is possible; readers skip it and
  the next start adds a newline so later records begin on their own line.

The event loop never waits for the disk: fsync, closing rotated files and deleting the
oldest ones happen on one background thread. The loop only does write(2) (a copy into
the page cache) and, once per rotation, rename(2) + open(2).

Not thread-safe: call `write` from one thread (the event loop's).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Protocol

from modeldock.clock import Clock
from modeldock.usage.config import UsageConfig

log = logging.getLogger(__name__)
DAY = 86400


class UsageSinkError(Exception):
    """The usage file cannot be written; the message says which file, why, and what to do."""


class Sink(Protocol):
    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class StdoutSink:
    """Records on stdout, for a collector that reads container output. A blocked pipe blocks the loop."""

    def __init__(self, fd: int = 1) -> None:
        self._fd = fd

    def write(self, data: bytes) -> None:
        _write_all(self._fd, data)

    def close(self) -> None:
        pass


class FileSink:
    """The active file `<stem>.<replica><suffix>`; rotated ones `<stem>.<replica>.<UTC stamp><suffix>`."""

    def __init__(self, config: UsageConfig, clock: Clock, *, background: bool = True) -> None:
        self.path = config.active_path()
        self._config = config
        self._clock = clock
        self._syncing = config.fsync_interval_seconds > 0 or config.fsync_every_records > 0
        prefix = f"{self.path.stem}."
        self._rotated_re = re.compile(re.escape(prefix) + r"\d{8}T\d{12}Z" + re.escape(self.path.suffix) + "$")
        self._lock = threading.Lock()  # guards _fd swaps and _retired
        self._retired: list[int] = []
        self._written = 0  # records written (event loop only)
        self._synced = 0  # records known fsynced (background thread only)
        self._broken_line = False
        self._rotate_after = 0.0  # after a failed rotation, when to try again
        self._fd = self._open()
        self._size, self._day = self._current_state()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="usage-fsync", daemon=True)
            self._thread.start()

    @property
    def synced_records(self) -> int:
        """Records written so far that an fsync has covered."""
        return self._synced

    # -- event loop side ------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Append one whole line. Raises OSError (disk full, I/O error); the record is then lost."""
        now = self._clock.time()
        if self._size and now >= self._rotate_after and (
                self._size + len(data) > self._config.max_file_bytes
                or (self._config.rotate_daily and int(now // DAY) != self._day)):
            try:
                self._rotate(now)
            except OSError as exc:
                # Keep appending to the current file rather than lose records; try again in a minute.
                self._rotate_after = now + 60
                log.error("usage: cannot rotate %s (records still go to it): %s", self.path, exc)
        elif not self._size:
            self._day = int(now // DAY)
        if self._broken_line:
            data = b"\n" + data
        try:
            _write_all(self._fd, data)
        except OSError:
            # A part of the line may be in the file; start the next record on a fresh line.
            self._broken_line = True
            raise
        self._broken_line = False
        self._size += len(data)
        self._written += 1
        every = self._config.fsync_every_records
        if every and self._written - self._synced >= every:
            self._wake.set()

    def _rotate(self, now: float) -> None:
        target = self.path.with_name(f"{self.path.stem}.{_stamp(now)}{self.path.suffix}")
        bump = 0
        while target.exists():  # two rotations within one microsecond (a fake clock)
            bump += 1
            target = self.path.with_name(f"{self.path.stem}.{_stamp(now + bump * 1e-6)}{self.path.suffix}")
        os.rename(self.path, target)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError:
            os.rename(target, self.path)  # the open fd still points at it: keep one active file
            raise
        with self._lock:
            self._retired.append(self._fd)
            self._fd = fd
        self._size, self._day = 0, int(now // DAY)
        self._wake.set()

    # -- both ------------------------------------------------------------------------------

    def sync(self) -> None:
        """fsync what was written, close rotated files, delete the oldest beyond max_files.

        The background thread calls this; tests and `close` call it directly.
        """
        with self._lock:
            fd, retired, self._retired = self._fd, self._retired, []
        written = self._written
        for old in retired:
            try:
                if self._syncing:
                    os.fsync(old)
            finally:
                os.close(old)
        if self._syncing and written > self._synced:
            os.fsync(fd)
            self._synced = written
        if retired:
            self.prune()

    def prune(self) -> list[Path]:
        """Delete the oldest rotated files beyond max_files; returns what was deleted."""
        names = sorted(n for n in os.listdir(self.path.parent) if self._rotated_re.match(n))
        doomed = [self.path.parent / n for n in names[: max(0, len(names) - self._config.max_files)]]
        for path in doomed:
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        return doomed

    def close(self) -> None:
        """Stop the thread, fsync and close everything. Safe to call twice."""
        if self._thread is not None:
            self._stopping = True
            self._wake.set()
            self._thread.join()
            self._thread = None
        if self._fd >= 0:
            self.sync()
            os.close(self._fd)
            self._fd = -1

    # -- internals -------------------------------------------------------------------------

    def _run(self) -> None:
        interval = self._config.fsync_interval_seconds or None
        while not self._stopping:
            self._wake.wait(interval)
            self._wake.clear()
            if self._stopping:
                return
            try:
                self.sync()
            except OSError as exc:
                log.error("usage: fsync/rotation of %s failed: %s", self.path, exc)

    def _open(self) -> int:
        directory = self.path.parent
        hint = "make the directory writable by this process, mount a volume there, or set usage.stdout: true"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if not os.access(directory, os.W_OK | os.X_OK):
                # Rotation renames and creates files in the directory, not only the file itself.
                raise PermissionError(f"directory {directory} is not writable")
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as exc:
            raise UsageSinkError(f"usage.path: cannot write usage records to {self.path}: {exc} ({hint})") from None
        return fd

    def _current_state(self) -> tuple[int, int]:
        stat = os.fstat(self._fd)
        if stat.st_size:
            with open(self.path, "rb") as existing:
                existing.seek(-1, os.SEEK_END)
                # The last run died mid-line (a machine crash): end it, so the torn line stays alone.
                self._broken_line = existing.read(1) != b"\n"
        # A non-empty file from an earlier day is rotated by the first write of today.
        return stat.st_size, int((stat.st_mtime if stat.st_size else self._clock.time()) // DAY)


def _stamp(epoch: float) -> str:
    seconds, micros = divmod(int(round(epoch * 1e6)), 1_000_000)
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(seconds)) + f"{micros:06d}Z"
