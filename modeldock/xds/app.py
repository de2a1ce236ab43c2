"""The xDS server process: discovery -> snapshot -> resources -> ADS."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from envoy.service.discovery.v3 import ads_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from modeldock.clock import Clock, SystemClock
from modeldock.config import Config, ModelConfig
from modeldock.discovery.snapshot import SnapshotStore
from modeldock.discovery.sources import DiscoverySource, sources_from_config
from modeldock.health import Health
from modeldock.process import run_until_signalled
from modeldock.xds.builder import ResourceBuilder
from modeldock.xds.cache import ResourceCache
from modeldock.xds.protocol import StreamEvents
from modeldock.xds.resources import ENDPOINT_TYPE
from modeldock.xds.server import AdsServicer

log = logging.getLogger("modeldock.xds")


class XdsMetrics(StreamEvents):
    def __init__(self, registry: CollectorRegistry) -> None:
        self.clients = Gauge("modeldock_xds_connected_clients",
                             "ADS streams served (not those held before the first list)", registry=registry)
        self.pushes = Counter("modeldock_xds_pushes", "ADS responses sent", ["type"], registry=registry)
        self.resources = Counter("modeldock_xds_resources_pushed", "Resources sent in ADS responses", ["type"],
                                 registry=registry)
        self.nacks = Counter("modeldock_xds_nacks", "ADS responses rejected by a client", ["type"], registry=registry)
        self.age = Gauge("modeldock_xds_snapshot_age_seconds", "Seconds since discovery confirmed a model", ["model"],
                         registry=registry)
        self.endpoints = Gauge("modeldock_xds_endpoints", "Endpoints served per model", ["model"], registry=registry)
        self.stale = Gauge("modeldock_xds_stale", "1 when a model's snapshot is past the cutoff", ["model"],
                           registry=registry)

    def connected(self, delta: int) -> None:
        self.clients.inc(delta)

    def pushed(self, type_url: str, count: int) -> None:
        short = type_url.rsplit(".", 1)[-1]
        self.pushes.labels(short).inc()
        self.resources.labels(short).inc(count)

    def nacked(self, type_url: str, version: str, detail: str) -> None:
        self.nacks.labels(type_url.rsplit(".", 1)[-1]).inc()


@dataclass
class XdsOptions:
    config_path: Path
    host: str = "127.0.0.1"
    port: int = 18000
    kubeconfig: str | None = None
    tick_seconds: float = 0.5
    metrics_host: str | None = None  # default: `host`


class XdsServer:
    """Owns the snapshot store, the resource cache and the discovery tasks."""

    def __init__(self, config: Config, options: XdsOptions, clock: Clock | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.options = options
        self.clock = clock or SystemClock()
        self.registry = registry or CollectorRegistry()
        self.metrics = XdsMetrics(self.registry)
        self.store = SnapshotStore(self.clock)
        self.cache = ResourceCache()
        self.builder = ResourceBuilder(config.models, config.discovery.stale_after_seconds,
                                       started_at=self.clock.monotonic())
        # Streams are held until the first rebuild after discovery's first list (see start).
        self.servicer = AdsServicer(self.cache, self.metrics, serving=False)
        self.health = Health("envoy.service.discovery.v3.AggregatedDiscoveryService")
        self._tasks: list[asyncio.Task[None]] = []
        self.sources: list[DiscoverySource] = []  # made at start (a Kubernetes client reads its kubeconfig)
        self._server: grpc.aio.Server | None = None
        self._stale: frozenset[str] = frozenset()
        self.bound_port = 0
        self._rebuild_pending = False
        # Each model's gauges (age, endpoints, stale), and the snapshot entry they were last set from.
        self._gauges = {m.name: (self.metrics.age.labels(m.name), self.metrics.endpoints.labels(m.name),
                                 self.metrics.stale.labels(m.name)) for m in config.models}
        self._seen: dict[str, object] = {}

    def rebuild(self, ages: bool = False) -> None:
        """Build the resources for the current snapshot; the gauges of the models that changed.

        `ages`: set every model's age gauge too (the tick does, so a change to one of
        1,000 models costs that model's gauges, not 3,000 label lookups).
        """
        now = self.clock.monotonic()
        snapshot = self.store.current
        resources = self.builder.build(snapshot, now)
        stale = self.builder.stale
        flipped = stale ^ self._stale
        if flipped:
            for model in stale - self._stale:
                log.error("model %s: discovery has not confirmed endpoints for %.1fs; dispatch stopped",
                          model, self.builder.age(snapshot, model, now))
            for model in self._stale - stale:
                log.info("model %s: discovery confirmed again; dispatch resumed", model)
            self._stale = stale
        if self.cache.set(resources):
            log.debug("resources now at EDS version %s", resources.versions.get(ENDPOINT_TYPE))
        entries, seen = snapshot.models, self._seen
        for name, (age, endpoints, is_stale) in self._gauges.items():
            entry = entries.get(name)
            if ages:
                age.set(self.builder.age(snapshot, name, now))
            if seen.get(name) is entry and name not in flipped:
                continue
            seen[name] = entry
            endpoints.set(0 if name in stale or entry is None else len(entry.endpoints))
            is_stale.set(1 if name in stale else 0)

    async def start(self) -> None:
        # Listen at once, but answer only with the full state: a client that reconnects
        # meanwhile waits on an open stream rather than backing off (Envoy's backoff
        # grows to 30 s), so it is answered as soon as the first list is in.
        self._server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 * 1024 * 1024)])
        ads_pb2_grpc.add_AggregatedDiscoveryServiceServicer_to_server(self.servicer, self._server)
        self.health.add_to(self._server)
        await self.health.set_serving(False)
        self.bound_port = self._server.add_insecure_port(f"{self.options.host}:{self.options.port}")
        await self._server.start()
        log.info("xDS server listening on %s:%d (%d models)",
                 self.options.host, self.bound_port, len(self.config.models))
        self.sources = sources_from_config(self.config, self.store, config_path=self.options.config_path,
                                           kubeconfig=self.options.kubeconfig)
        for source in self.sources:
            self._tasks.append(asyncio.create_task(source.run(), name=f"{source.kind}-discovery"))
        await self._initial_sync([m for m in self.config.models if m.source == "kubernetes"])
        self.rebuild(ages=True)
        self.store.subscribe(lambda _snapshot: self._schedule_rebuild())
        self._tasks.append(asyncio.create_task(self._tick(), name="staleness"))
        self.servicer.start_serving()
        await self.health.set_serving(True)
        log.info("xDS server serving (EDS version %s)", self.cache.current.versions.get(ENDPOINT_TYPE))

    async def _initial_sync(self, models: list[ModelConfig], timeout: float = 5.0) -> None:
        """Have the full state before answering: wait (bounded) for discovery's first list."""
        deadline = self.clock.monotonic() + min(timeout, self.config.discovery.stale_after_seconds)
        while any(m.name not in self.store.current.models for m in models):
            if self.clock.monotonic() > deadline:
                missing = [m.name for m in models if m.name not in self.store.current.models]
                log.warning("serving before discovery listed models %s", ", ".join(missing))
                return
            await asyncio.sleep(0.02)

    def _schedule_rebuild(self) -> None:
        # Sources confirm often; coalesce a burst of store changes into one rebuild.
        if not self._rebuild_pending:
            self._rebuild_pending = True
            asyncio.get_running_loop().call_soon(self._run_scheduled)

    def _run_scheduled(self) -> None:
        self._rebuild_pending = False
        self.rebuild()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.options.tick_seconds)
            self.rebuild(ages=True)

    async def stop(self, grace: float = 2.0) -> None:
        await self.health.shutdown()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            # Streams never end on their own: end them, so stop() need not wait out the grace.
            self.servicer.close_streams()
            await self._server.stop(grace)


async def serve(config: Config, options: XdsOptions, metrics_port: int | None) -> None:
    server = XdsServer(config, options)

    async def stop() -> None:
        log.info("xDS server shutting down")
        await server.stop()

    await run_until_signalled(server.start, stop, registry=server.registry, host=options.metrics_host or options.host,
                              metrics_port=metrics_port)
