"""Static discovery: endpoints listed in the config file, re-read when the file changes."""

from __future__ import annotations

import logging
from pathlib import Path

from modeldock.config import ConfigError, ModelConfig, load_config
from modeldock.discovery.snapshot import SnapshotStore
from modeldock.filewatch import FileWatch

log = logging.getLogger("modeldock.discovery")


class StaticDiscovery:
    """Publishes `endpoints:` lists. A file cannot go stale, so every poll confirms."""

    kind = "static"

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
        self.models = frozenset(self._names)
        self._store = store
        self._publish(models)
        self._watch = FileWatch(self._path, self._reload, interval=poll_interval, on_poll=self._confirm)

    def _publish(self, models: list[ModelConfig]) -> None:
        for model in models:
            if model.name in self._names and model.endpoints is not None:
                self._store.update(model.name, model.static_endpoints())

    def _reload(self) -> None:
        try:
            config = load_config(self._path)
        except ConfigError as exc:
            log.error("keeping the last good endpoints; %s", exc)
            return
        self._publish(config.models)
        log.info("re-read static endpoints from %s", self._path)

    def _confirm(self) -> None:
        for name in self._names:
            self._store.confirm(name)

    def poll_once(self) -> None:
        self._watch.check()

    async def run(self) -> None:
        await self._watch.run()
