"""Notice when a file changes, by polling its (mtime, size).

Polling follows the symlink swap of a mounted Kubernetes Secret or ConfigMap,
which inotify-style watches of the path miss. A missing or unreadable file is
not a change: the last good contents stay in use until it is readable again.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

Stamp = tuple[int, int]


def file_stamp(path: Path) -> Stamp | None:
    try:
        st = os.stat(path)  # follows symlinks
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


class FileWatch:
    """Calls `on_change()` when the file's stamp differs from the last one seen, and
    `on_poll()` (if given) after every poll, changed or not."""

    def __init__(self, path: str | Path, on_change: Callable[[], None], *, interval: float = 1.0,
                 on_poll: Callable[[], None] | None = None) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0")
        self.path = Path(path)
        self.interval = interval
        self._on_change = on_change
        self._on_poll = on_poll
        self._seen: Stamp | None = file_stamp(self.path)  # the contents already in use

    def check(self) -> bool:
        """One poll; True when the file changed (and on_change ran)."""
        stamp = file_stamp(self.path)
        changed = stamp is not None and stamp != self._seen
        if changed:
            self._seen = stamp
            self._on_change()
        if self._on_poll is not None:
            self._on_poll()
        return changed

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.check()
