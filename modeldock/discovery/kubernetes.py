"""Kubernetes discovery: each model's endpoints from its Service's EndpointSlices.

One informer per namespace: a `NamespaceWatch` thread (list, then watch, on
the official synchronous client) feeds a `NamespaceIndex` (the slices of the
Services models name, by Service). After each list or event only the touched
Services' models are recomputed; every event, bookmark and clean end of a
watch also vouches for the rest of the namespace, since the server delivers a
namespace's changes in order. Threads post results to an `Outbox`, which
hands them to the event loop in batches (one `call_soon_threadsafe` per
batch); there the changed models are updated and the others confirmed in one
store swap. Only namespaced `list` and `watch` on `discovery.k8s.io`
endpointslices are needed (a Role per namespace, not a ClusterRole).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import threading
from collections.abc import Callable, Mapping

import kubernetes.config
import urllib3
from kubernetes.client import ApiClient, Configuration, DiscoveryV1Api, V1EndpointSlice

from modeldock.config import ModelConfig
from modeldock.discovery.kube_cache import Found, NamespaceIndex, Target
from modeldock.discovery.kube_watch import (
    THREAD_PREFIX,
    URLLIB3_POOL_LOGGER,
    NamespaceWatch,
    QuietRetries,
    WatchSettings,
)
from modeldock.discovery.snapshot import SnapshotStore
from modeldock.types import Endpoint

log = logging.getLogger("modeldock.discovery")

LOGGED_PER_MODEL = 10  # a batch changing more models than this is logged as one line


def load_api_client(kubeconfig: str | None = None) -> ApiClient:
    """A client for the cluster, leaving the library's global default configuration alone.

    An explicit kubeconfig wins; otherwise the pod's service account when
    running in a pod, else $KUBECONFIG or ~/.kube/config.
    """
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = Configuration()
        kubernetes.config.load_incluster_config(client_configuration=configuration)
        return ApiClient(configuration)
    # persist_config=False: never write refreshed credentials back into the user's file.
    client: ApiClient = kubernetes.config.new_client_from_config(config_file=kubeconfig, persist_config=False)
    return client


def watching_client(api_client: ApiClient, connections: int = 0) -> ApiClient:
    """A new client with `api_client`'s settings, but no urllib3 read retries.

    We recover by resuming or listing again; urllib3 retrying a read timeout
    against a hung server would multiply every timeout by four before we
    notice. Connect retries stay. The pool keeps at least `connections` (one
    per watch thread), so no thread's keep-alive connection is dropped for
    want of room. The caller's client is left as it was.
    """
    configuration = copy.deepcopy(api_client.configuration)
    configuration.retries = urllib3.Retry(total=3, read=0)
    configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize or 1, connections)
    return ApiClient(configuration)


class Outbox:
    """Watch threads -> the event loop, coalesced: one `call_soon_threadsafe` per batch.

    Whatever threads post while a delivery is pending joins it (a model's
    newest endpoints win), so a burst of events costs the loop one call.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[Found, frozenset[str]], None]) -> None:
        self._loop = loop
        self._deliver = deliver
        self._lock = threading.Lock()
        self._found: Found = {}
        self._confirmed: set[str] = set()
        self._scheduled = False
        self.calls = 0  # call_soon_threadsafe calls made, for tests

    def post(self, found: Mapping[str, frozenset[Endpoint]], confirmed: frozenset[str]) -> None:
        """On a watch thread: these models have these endpoints now; `confirmed` are still current."""
        with self._lock:
            self._found.update(found)
            self._confirmed |= confirmed
            if self._scheduled:
                return
            self._scheduled = True
            self.calls += 1
        with contextlib.suppress(RuntimeError):  # the loop is closed: we are shutting down
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            found, confirmed = self._found, frozenset(self._confirmed)
            self._found, self._confirmed, self._scheduled = {}, set(), False
        self._deliver(found, confirmed)


class NamespaceFeed:
    """A namespace's `WatchHandler`: its index, and what each list or event gives the outbox."""

    def __init__(self, index: NamespaceIndex, outbox: Outbox) -> None:
        self._index = index
        self._outbox = outbox

    def listed(self, items: list[V1EndpointSlice]) -> None:
        self._outbox.post(self._index.replace(items), self._index.models)

    def changed(self, kind: str, obj: object) -> bool:
        found = self._index.apply(kind, obj)
        if found is None:
            return False
        self._outbox.post(found, self._index.models)  # an event vouches for the namespace up to it
        return True

    def synced(self) -> None:
        self._outbox.post({}, self._index.models)


class KubernetesDiscovery:
    """Publishes the ready endpoints of every model that has a `kubernetes:` target."""

    kind = "kubernetes"

    def __init__(
        self,
        models: list[ModelConfig],
        store: SnapshotStore,
        api_client: ApiClient,
        *,
        watch_timeout_seconds: int = 60,
        request_timeout_seconds: float = 10.0,
        backoff_base_seconds: float = 0.2,
        backoff_max_seconds: float = 5.0,
    ) -> None:
        # namespace -> service -> [(model, port)]
        self._targets: dict[str, dict[str, list[Target]]] = {}
        for model in models:
            if model.kubernetes is not None:
                services = self._targets.setdefault(model.kubernetes.namespace, {})
                services.setdefault(model.kubernetes.service, []).append((model.name, model.kubernetes.port))
        self.models = frozenset(
            name for services in self._targets.values() for targets in services.values() for name, _ in targets
        )
        self._store = store
        self._client = watching_client(api_client, connections=len(self._targets) + 1)
        self._api = DiscoveryV1Api(self._client)
        self._settings = WatchSettings(
            watch_timeout_seconds=watch_timeout_seconds,
            request_timeout_seconds=request_timeout_seconds,
            backoff_base_seconds=backoff_base_seconds,
            backoff_max_seconds=backoff_max_seconds,
        )
        self._published: dict[str, frozenset[Endpoint]] = {}
        self._threads: list[threading.Thread] = []
        self._indexes: list[NamespaceIndex] = []
        self.outbox: Outbox | None = None  # of the current or last `run`
        self._active = False

    @property
    def settings(self) -> WatchSettings:
        return self._settings

    @property
    def namespaces(self) -> list[str]:
        """The namespaces watched: one watch (and one thread) each, however many Services and models."""
        return sorted(self._targets)

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads of the current or last `run`."""
        return list(self._threads)

    @property
    def indexes(self) -> list[NamespaceIndex]:
        """The namespaces' caches of the current or last `run`; each is written by its own thread only."""
        return list(self._indexes)

    async def run(self) -> None:
        """Watch until cancelled; cancellation stops and joins the worker threads."""
        outbox = self.outbox = Outbox(asyncio.get_running_loop(), self._publish)
        self._indexes = [NamespaceIndex(ns, services) for ns, services in sorted(self._targets.items())]
        watches = [
            NamespaceWatch(index.namespace, self._api, NamespaceFeed(index, outbox), self._settings)
            for index in self._indexes
        ]
        self._threads = [
            threading.Thread(target=watch.run, name=f"{THREAD_PREFIX} {watch.name}", daemon=True) for watch in watches
        ]
        quiet = QuietRetries()
        logging.getLogger(URLLIB3_POOL_LOGGER).addFilter(quiet)
        self._active = True
        for thread in self._threads:
            thread.start()
        try:
            await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            self._active = False  # results already queued to the loop are dropped
            await self._stop(watches)
            logging.getLogger(URLLIB3_POOL_LOGGER).removeFilter(quiet)
            if not any(thread.is_alive() for thread in self._threads):
                self._client.close()  # idle connections only; a later run() opens new ones

    async def _stop(self, watches: list[NamespaceWatch]) -> None:
        # An open watch is cut at once by closing its socket. A request still
        # waiting for an answer cannot be interrupted: a list ends within
        # request_timeout_seconds, so wait that long; a watch whose server hangs
        # before answering takes longer and is left to its (daemon) thread.
        deadline = asyncio.get_running_loop().time() + self._settings.request_timeout_seconds + 1
        while True:
            for watch in watches:
                watch.stop()  # again each round: a watch that connected after the last call
            alive = [thread for thread in self._threads if thread.is_alive()]
            if not alive or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.02)
        for thread in alive:
            log.warning("%s is still in a request; it exits when that times out, without publishing", thread.name)

    def _publish(self, found: Found, confirmed: frozenset[str]) -> None:
        """On the loop: update the models whose endpoints changed, confirm the others, in one swap."""
        if not self._active:
            return
        changes = {model: endpoints for model, endpoints in found.items() if self._published.get(model) != endpoints}
        self._published.update(changes)
        # Never confirm what was never listed: that would publish an empty list as current.
        still = [model for model in (confirmed | found.keys()) - changes.keys() if model in self._published]
        self._store.update_many(changes, still)
        level = logging.INFO if len(changes) <= LOGGED_PER_MODEL else logging.DEBUG
        for model, endpoints in sorted(changes.items()):
            log.log(level, "model %s: %d ready endpoint(s) from EndpointSlices", model, len(endpoints))
        if level == logging.DEBUG:
            log.info("%d models: new endpoints from EndpointSlices", len(changes))
