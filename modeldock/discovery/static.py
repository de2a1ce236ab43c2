"""Static discovery: endpoints listed in the config file, re-read when the file changes."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from modeldock.config import ConfigError, ModelConfig, load_config
from modeldock.discovery.snapshot import SnapshotStore

log = logging.getLogger("modeldock.discovery")


class StaticDiscovery:
    """Publishes `endpoints:` lists. A file cannot go stale, so every poll confirms."""

    def __init__(
        self,
        path: str | Path,
        models: list[ModelConfig],
        store: SnapshotStore,
        *,
        poll_interval: float = 1.0,
    ) -> None:
        self._path = Path(path)
        self._names = {m.name for m in models if m.endpoints is not None}
        self._store = store
        self._poll = poll_interval
        self._stamp: tuple[int, int] | None = None
        self._publish(models)

    def _publish(self, models: list[ModelConfig]) -> None:
        for model in models:
            if model.name in self._names and model.endpoints is not None:
                self._store.update(model.name, model.static_endpoints())

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def poll_once(self) -> None:
        stamp = self._file_stamp()
        if stamp is not None and stamp != self._stamp:
            self._stamp = stamp
            try:
                config = load_config(self._path)
            except ConfigError as exc:
                log.error("keeping the last good endpoints; %s", exc)
            else:
                self._publish(config.models)
                log.info("re-read static endpoints from %s", self._path)
        for name in self._names:
            self._store.confirm(name)

    async def run(self) -> None:
        self._stamp = self._file_stamp()
        while True:
            await asyncio.sleep(self._poll)
            self.poll_once()
