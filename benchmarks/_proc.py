"""What a benchmark reads about a process from /proc: CPU seconds, resident memory, threads and TCP
connections."""

from __future__ import annotations

import os
import threading
from pathlib import Path

_CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used; 0.0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLK


def rss_mb(pid: int) -> float:
    """Resident set size in MiB; 0.0 once the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0.0
    for line in lines:
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def status(pid: int) -> tuple[float, int]:
    """(RSS MiB, threads) from /proc/<pid>/status."""
    threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss_mb(pid), threads


def tcp_connections(pid: int, port: int) -> int:
    """ESTABLISHED TCP connections the process holds to 127.0.0.1:`port` (its fds' socket inodes)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "01" and int(cols[2].rsplit(":", 1)[1], 16) == port and cols[9] in inodes:
                count += 1
    return count


def thread_cpu(name: str) -> float:
    """CPU seconds of this process's thread called `name`."""
    for thread in threading.enumerate():
        if thread.name == name and thread.native_id is not None:
            cols = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(cols[11]) + int(cols[12])) / _CLK
    return 0.0
