"""The `usage:` section: where usage records go, how often they reach the disk, how many files stay.

Mounted into the main config as `usage:` (absent = no usage records).
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

REPLICA_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


class UsageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    # The active file is `<stem>.<replica><suffix>` beside this path, e.g. usage.gw-7f9c.jsonl,
    # so replicas sharing a volume never share a file.
    path: Path = Path("/var/lib/modeldock/usage.jsonl")
    # Write records to stdout instead of a file (for a log collector that reads container output).
    stdout: bool = False
    # Names this replica in file names and records; default: $MODELDOCK_REPLICA, else the host name.
    replica: Annotated[str, Field(pattern=REPLICA_RE.pattern)] | None = None
    # fsync at most this long after a record is written (0 = leave it to the kernel's writeback).
    fsync_interval_seconds: Annotated[float, Field(ge=0, le=60)] = 1.0
    # Also fsync once this many records are unsynced (0 = only the timer).
    fsync_every_records: Annotated[int, Field(ge=0)] = 0
    # Rotate when the active file would pass this size, and (if rotate_daily) at 00:00 UTC.
    max_file_bytes: Annotated[int, Field(ge=4096)] = 64 * 1024 * 1024
    rotate_daily: bool = True
    # Rotated files kept per replica; the oldest beyond this are deleted. Ship them before then.
    max_files: Annotated[int, Field(ge=1, le=10_000)] = 30
    # Distinct (tenant, model) label sets on modeldock_tokens_total before new ones go to `other`.
    max_label_sets: Annotated[int, Field(ge=1)] = 2000

    @field_validator("path")
    @classmethod
    def _path(cls, value: Path) -> Path:
        if not value.name or value.name in (".", ".."):
            raise ValueError("must name a file, e.g. /var/lib/modeldock/usage.jsonl")
        return value

    def replica_id(self) -> str:
        if self.replica:
            return self.replica
        raw = os.environ.get("MODELDOCK_REPLICA") or socket.gethostname() or "replica"
        return _UNSAFE.sub("-", raw).strip("-")[:64] or "replica"

    def active_path(self) -> Path:
        """The file this replica appends to."""
        return self.path.with_name(f"{self.path.stem}.{self.replica_id()}{self.path.suffix}")
