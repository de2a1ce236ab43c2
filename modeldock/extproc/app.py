"""The ext_proc process: the gRPC server, the ADS client that feeds it, metrics, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from modeldock.admission.limits import Admission
from modeldock.budgets.budgets import TokenBudgets
from modeldock.clock import Clock, SystemClock
from modeldock.config import Config, ConfigError, load_config
from modeldock.epp import PickerOptions, PickerServicer
from modeldock.epp.protocol import HEALTH_SERVICES
from modeldock.extproc.attempts import AttemptLogServicer
from modeldock.extproc.server import ExtProcServicer
from modeldock.extproc.wire import add_servicer
from modeldock.filewatch import FileWatch
from modeldock.flowcontrol import QueueMetrics
from modeldock.flowcontrol.dispatcher import Dispatcher
from modeldock.gateway import Gateway
from modeldock.gateway.lifecycle import Lifecycle, Outcome
from modeldock.gateway.settlement import UsageReport
from modeldock.health import Health
from modeldock.picking.factory import build_picker
from modeldock.picking.picker import Picker
from modeldock.picking.scrape import Scraper
from modeldock.process import freeze_startup_objects, run_until_signalled
from modeldock.redis_client import make_redis_client
from modeldock.redis_metrics import RedisMetrics, topology_of
from modeldock.sharing.store import RedisShareStore
from modeldock.sharing.sync import Sharing, SharingMetrics
from modeldock.types import Endpoint, cluster_name
from modeldock.usage.log import UsageLog
from modeldock.xds.client import AdsClient

log = logging.getLogger("modeldock.extproc")


@dataclass
class ExtProcOptions:
    xds_target: str
    host: str = "127.0.0.1"
    port: int = 18001
    config_path: Path | None = None  # re-read when it changes (tenants, keys, limits)
    reload_interval: float = 1.0
    # On SIGTERM, report NOT_SERVING and keep serving new streams this long before
    # draining, so Envoy's health checks move new requests to other replicas first.
    drain_delay: float = 0.0
    metrics_host: str | None = None  # default: `host`
    # Picker mode (modeldock/epp/): speak GIE's Endpoint Picker protocol to a gateway's Envoy
    # instead of answering modeldock's own bootstrap. None: the bootstrap's protocol.
    picker: PickerOptions | None = None
    tls_cert: Path | None = None  # serve gRPC over TLS (Envoy AI Gateway's picker cluster speaks only TLS)
    tls_key: Path | None = None


class ExtProcMetrics:
    """The request metrics; the lifecycle's hooks (gateway/lifecycle.py `Hooks`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # tenant and model are configured names or "" (config-bounded): see Rejection.tenant.
        self.requests = Counter(
            "modeldock_requests", "Requests by outcome, status, tenant and model",
            ["outcome", "status", "tenant", "model"], registry=registry,
        )
        self.duration = Histogram(
            "modeldock_request_duration_seconds", "Time from first ext_proc message to end of stream",
            buckets=(0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=registry,
        )
        self._children: dict[tuple[str, int, str, str], Counter] = {}  # labels() children, looked up once
        self.streams = Gauge("modeldock_extproc_streams", "ext_proc streams open", registry=registry)
        self.in_flight = Gauge("modeldock_in_flight", "Requests counted in flight", registry=registry)
        self.pending_settlements = Gauge(
            "modeldock_usage_pending_settlements",
            "Ended requests waiting for Envoy's usage report (settled when it comes, or after ~2 s)",
            registry=registry)
        self.usage_reports = Counter(
            "modeldock_usage_reports", "Entries of Envoy's per-request usage log heard (every replica hears all)",
            registry=registry)
        self.retries = Counter("modeldock_retries_seen",
                               "Retries onto a fallback endpoint that Envoy reported (failures before the first byte)",
                               registry=registry)

    def on_finished(self, flow: Outcome, seconds: float) -> None:
        key = (flow.outcome, flow.status, flow.tenant_id, flow.model_name)
        counter = self._children.get(key)
        if counter is None:
            # A proxied request's status is the upstream's, which ext_proc does not see: left empty.
            status = str(flow.status) if flow.status else ""
            counter = self._children[key] = self.requests.labels(flow.outcome, status, flow.tenant_id,
                                                                 flow.model_name)
        counter.inc()
        if flow.outcome == "proxied":
            self.duration.observe(seconds)

    def on_retried(self, _flow: Outcome) -> None:
        self.retries.inc()

    def on_reported(self, _report: UsageReport) -> None:
        self.usage_reports.inc()


# Envoy sends the whole buffered body in one gRPC message, with the request attributes (method, path,
# x-request-id, Authorization). Attributes are request headers, which Envoy caps at 60 KiB by default
# (max_request_headers_kb), so 1 MiB covers them and the protobuf framing with room to spare.
RECEIVE_HEADROOM_BYTES = 1024 * 1024


def grpc_receive_limit(max_body_bytes: int) -> int:
    """`grpc.max_receive_message_length` for ext_proc: a body of `max_body_bytes` plus its attributes."""
    return max_body_bytes + RECEIVE_HEADROOM_BYTES


class ExtProcServer:
    def __init__(self, config: Config, options: ExtProcOptions, clock: Clock | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.clock = clock or SystemClock()
        self.options = options
        self.registry = registry or CollectorRegistry()
        self.metrics = ExtProcMetrics(self.registry)
        self.picker = build_picker(config.routing, self.clock, self.registry)
        # An endpoint is read every interval while requests run there or its model queues (here or at a
        # peer), less often otherwise; a pick there puts it on the busy cadence, an ending reads it again.
        self.scraper = Scraper.from_config(self.picker, self.clock, config.routing, registry=self.registry,
                                           queued=lambda: [q.model for q in self.gateway.flow.queues
                                                           if len(q) or q.peer_flows])
        self.picker.add_release_listener(self.scraper.refresh)
        self.picker.add_claim_listener(self.scraper.hurry)
        self.picker.add_target_listener(self.scraper.targets_changed)
        self.xds = AdsClient(
            options.xds_target,
            [cluster_name(m.name) for m in config.models],
            node_id=f"modeldock-extproc-{os.getpid()}",
            clock=self.clock,
            on_endpoints=lambda model, endpoints: self.gateway.on_endpoints(model, endpoints),
            on_status=lambda stale: self.gateway.on_status(stale),
        )
        self.redis_metrics = RedisMetrics(self.registry)
        self.redis_metrics.set_topology(topology_of(config.limits.redis_url, config.limits.redis_cluster))
        self.admission = Admission(config, self.clock, registry=self.registry, redis_metrics=self.redis_metrics)
        # Usage records (config `usage:`); raises UsageSinkError, naming the path, if they cannot be written.
        self.usage = UsageLog.open(config.usage, self.clock, self.registry)
        self.gateway = Gateway(config, self.clock, self.picker, self.admission, xds_down_for=self.xds.disconnected_for,
                               queue_metrics=QueueMetrics(self.registry), usage_log=self.usage,
                               budgets=TokenBudgets(config, self.clock, redis_metrics=self.redis_metrics))
        # The one place the mode is chosen: the adapter, and when the registry settles (at each stream end
        # in picker mode, where a gateway modeldock did not configure sends no usage or retry log).
        self.lifecycle = Lifecycle(self.gateway, self.metrics, await_reports=options.picker is None)
        self.servicer: ExtProcServicer | PickerServicer = (
            ExtProcServicer(self.gateway, self.lifecycle) if options.picker is None
            else PickerServicer(self.gateway, options.picker, self.lifecycle))
        self.attempts = AttemptLogServicer(self.lifecycle.retried, self.lifecycle.reported)
        self.metrics.streams.set_function(lambda: self.servicer.open_streams)
        self.metrics.in_flight.set_function(lambda: self.picker.total_in_flight())
        self.metrics.pending_settlements.set_function(lambda: self.lifecycle.pending())
        self.sharing = _sharing(config, self.picker, self.scraper, self.gateway.flow, self.clock, self.registry)
        if self.sharing is None:
            SharingMetrics(self.registry)  # exported all the same: `modeldock_sharing_shared 0` says it is off
        self._server: grpc.aio.Server | None = None
        # Fixed when the server is built: a reload cannot change it (see _watch_config).
        self.receive_limit = grpc_receive_limit(config.limits.max_body_bytes)
        self._tasks: list[asyncio.Task[None]] = []
        self.bound_port = 0
        self.health = (
            Health(*HEALTH_SERVICES) if options.picker else Health("envoy.service.ext_proc.v3.ExternalProcessor")
        )
        self._draining = False

    async def start(self) -> None:
        self._tasks.append(asyncio.create_task(self.xds.run(), name="xds-client"))
        self.scraper.start()
        if self.sharing is not None:
            self.sharing.start()
        if self.options.config_path is not None:
            path = self.options.config_path
            watch = FileWatch(path, lambda: self._reload_config(path), interval=self.options.reload_interval)
            self._tasks.append(asyncio.create_task(watch.run(), name="reload"))
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", self.receive_limit)])
        add_servicer(self.servicer, self._server)
        self.attempts.add_to(self._server)
        self.health.add_to(self._server)
        await self.health.set_serving(False)
        address = f"{self.options.host}:{self.options.port}"
        if self.options.tls_cert is not None and self.options.tls_key is not None:
            credentials = grpc.ssl_server_credentials(
                [(self.options.tls_key.read_bytes(), self.options.tls_cert.read_bytes())]
            )
            self.bound_port = self._server.add_secure_port(address, credentials)
        else:
            self.bound_port = self._server.add_insecure_port(address)
        await self._server.start()
        self._tasks.append(asyncio.create_task(self._serving_when_synced(), name="health"))
        log.info("ext_proc listening on %s:%d, endpoints from xDS at %s",
                 self.options.host, self.bound_port, self.options.xds_target)

    async def _serving_when_synced(self) -> None:
        # Until the first endpoints arrive every request would get a 503: not ready yet.
        await self.xds.synced.wait()
        if self.sharing is not None:
            # A new replica that knew nothing of its peers' requests would start by overcommitting the
            # room they hold: ready after the first exchange (bounded: with Redis down, the local view).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.sharing.ttl):
                    await self.sharing.first.wait()
        if not self._draining:
            await self.health.set_serving(True)

    def _reload_config(self, path: Path) -> None:
        try:
            config = load_config(path)  # $REDIS_URL applies as at start
        except ConfigError as exc:
            log.error("config reload failed; keeping the last good config\n%s", exc)
            return
        if [m.name for m in config.models] != [m.name for m in self.gateway.config.models]:
            log.warning("config reload: the model list changed; restart the xDS server and ext_proc to apply it")
        if config.usage != self.gateway.config.usage:
            log.warning("config reload: `usage:` changed; restart ext_proc to apply it")
        if grpc_receive_limit(config.limits.max_body_bytes) > self.receive_limit:
            log.warning("config reload: limits.max_body_bytes rose to %d; bodies above %d bytes need a "
                        "restart of ext_proc (its gRPC receive limit) and of Envoy (its buffer limit, "
                        "`modeldock envoy-config --max-body-bytes`)", config.limits.max_body_bytes,
                        self.receive_limit - RECEIVE_HEADROOM_BYTES)
        self.gateway.apply_config(config)
        self.redis_metrics.set_topology(topology_of(config.limits.redis_url, config.limits.redis_cluster))
        log.info("config reloaded from %s (%d tenants)", path, len(config.tenants))

    async def stop(self, grace: float = 10.0) -> None:
        self._draining = True
        await self.health.shutdown()
        if self.options.drain_delay > 0 and self._server is not None:
            log.info("ext_proc reports NOT_SERVING; still taking streams for %.1fs", self.options.drain_delay)
            await asyncio.sleep(self.options.drain_delay)
        # Let in-flight streams finish: killing ext_proc aborts every HTTP stream
        # that Envoy still routes through it (failure_mode_allow is false).
        if self._server is not None:
            stopping = asyncio.create_task(self._server.stop(grace))
            # Retry reports matter while ext_proc streams are open; then the log streams
            # (which Envoy never ends) must not hold the stop up for the whole grace period.
            while self.servicer.open_streams and not stopping.done():
                await asyncio.sleep(0.05)
            # The usage reports of the last streams come a few ms after they end: wait for them (bounded).
            settlements = self.lifecycle.settlements
            deadline = asyncio.get_running_loop().time() + settlements.grace
            while len(settlements) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            self.attempts.close()
            await stopping
        self.lifecycle.settlements.flush()
        await self.lifecycle.settlements.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.scraper.stop()
        if self.sharing is not None:
            await self.sharing.stop()
        await self.admission.close()
        await self.gateway.budgets.close()
        self.usage.close()  # after draining: every settled request's record is written


def _sharing(config: Config, picker: Picker, scraper: Scraper, flow: Dispatcher, clock: Clock,
             registry: CollectorRegistry) -> Sharing | None:
    """The shared load state (modeldock/sharing): on by default when a Redis is configured."""
    url = config.limits.redis_url
    enabled = config.sharing.enabled if config.sharing.enabled is not None else url is not None
    if not enabled:
        return None
    if url is None:
        raise ConfigError("sharing.enabled: true needs a Redis: set limits.redis_url (or $REDIS_URL)")
    timeout = config.sharing.timeout_ms / 1000.0
    # No socket timeout on either (every exchange is bounded by asyncio.timeout in Sharing, and a
    # subscription idles): redis-py would wrap every send in a task of its own.
    cluster, auth = config.limits.redis_cluster, config.limits.redis_auth
    store = RedisShareStore(make_redis_client(url, timeout, batch=True, cluster=cluster, auth=auth),
                            make_redis_client(url, timeout, batch=True, cluster=cluster, auth=auth))
    split = config.sharing.split_scraping
    sharing = Sharing(picker, store, clock, config.sharing, registry, standing=flow.standing,
                      queues=flow, pages=picker if split else None)
    picker.add_claim_listener(sharing.changed)  # pushed at once where a peer's decision can turn on it
    picker.add_release_listener(sharing.changed)
    if split:
        _split_scraping(config, picker, scraper, sharing)
    log.info("sharing load state with the other replicas through Redis as %s (every %d ms, forgotten after %d ms)",
             sharing.replica, config.sharing.interval_ms, config.sharing.ttl_ms)
    return sharing


def _split_scraping(config: Config, picker: Picker, scraper: Scraper, sharing: Sharing) -> None:
    """Each endpoint read by its owner (sharing/split.py), its pages relayed (picking/relay.py).

    A replica reads an endpoint it does not own when no page of it arrived for longer than the
    owner's idle cadence allows (the owner died, lags, or has not got the endpoint yet): a late
    relay costs a read, never a stale sample for long. Peers' requests there count as busy."""
    routing, scrape = config.routing, config.routing.scrape
    relay = 2 * config.sharing.interval_ms / 1000.0  # into the owner's next share, then to each peer
    # The idle cadence's bound (picking/config.py) with the relay inside it: a relayed page lands
    # before the stale cutoff too.
    idle = min(routing.idle_interval, routing.stale_after_seconds - scrape.timeout_seconds - relay - 0.05)
    late = idle + scrape.timeout_seconds + relay

    def scrapes(ep: Endpoint) -> bool:
        return sharing.split.owns(ep.address) or picker.sample_age(ep) > late

    def busy(ep: Endpoint) -> bool:
        peers = picker.peers(ep)
        return peers is not None and peers.in_flight > 0

    scraper.share(scrapes, busy, idle)
    picker.add_peer_claim_listener(scraper.hurry)  # a peer's pick there: read it at the busy cadence


async def serve(config: Config, options: ExtProcOptions, metrics_port: int | None, grace: float) -> None:
    server = ExtProcServer(config, options)

    async def start() -> None:
        await server.start()
        freeze_startup_objects()  # the service process only: never in a test process

    async def stop() -> None:
        log.info("ext_proc draining (up to %.0fs)", grace)
        await server.stop(grace)

    await run_until_signalled(start, stop, registry=server.registry, host=options.metrics_host or options.host,
                              metrics_port=metrics_port)
