"""Kubernetes discovery: each model's endpoints from its Service's EndpointSlices.

One `ServiceWatch` thread per (namespace, service), shared by every model that
points at that Service. Threads compute each model's endpoints and hand them to
the event loop with `call_soon_threadsafe`; the store is only touched there.
Only namespaced `list` and `watch` on `discovery.k8s.io` endpointslices are
needed (a Role, not a ClusterRole).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import threading
from collections.abc import Callable

import kubernetes.config
import urllib3
from kubernetes.client import ApiClient, Configuration, DiscoveryV1Api

from modeldock.config import ModelConfig
from modeldock.discovery.kube_slices import merge_endpoints
from modeldock.discovery.kube_watch import (
    THREAD_PREFIX,
    URLLIB3_POOL_LOGGER,
    QuietRetries,
    ServiceWatch,
    Slices,
    WatchSettings,
)
from modeldock.discovery.snapshot import SnapshotStore
from modeldock.types import Endpoint

log = logging.getLogger("modeldock.discovery")

ServiceKey = tuple[str, str]  # (namespace, service)
Target = tuple[str, int | str]  # (model name, port name or number)


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


def watching_client(api_client: ApiClient) -> ApiClient:
    """A new client with `api_client`'s settings, but no urllib3 read retries.

    We recover by listing again; urllib3 retrying a read timeout against a
    hung server would multiply every timeout by four before we notice.
    Connect retries stay. The caller's client is left as it was.
    """
    configuration = copy.deepcopy(api_client.configuration)
    configuration.retries = urllib3.Retry(total=3, read=0)
    return ApiClient(configuration)


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
        self._targets: dict[ServiceKey, list[Target]] = {}
        for model in models:
            if model.kubernetes is not None:
                key = (model.kubernetes.namespace, model.kubernetes.service)
                self._targets.setdefault(key, []).append((model.name, model.kubernetes.port))
        self.models = frozenset(name for targets in self._targets.values() for name, _ in targets)
        self._store = store
        self._client = watching_client(api_client)
        self._api = DiscoveryV1Api(self._client)
        self._settings = WatchSettings(
            watch_timeout_seconds=watch_timeout_seconds,
            request_timeout_seconds=request_timeout_seconds,
            backoff_base_seconds=backoff_base_seconds,
            backoff_max_seconds=backoff_max_seconds,
        )
        self._published: dict[str, frozenset[Endpoint]] = {}
        self._threads: list[threading.Thread] = []
        self._active = False

    @property
    def settings(self) -> WatchSettings:
        return self._settings

    @property
    def services(self) -> list[ServiceKey]:
        """The Services watched: one watch each, however many models use it."""
        return sorted(self._targets)

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads of the current or last `run`."""
        return list(self._threads)

    async def run(self) -> None:
        """Watch until cancelled; cancellation stops and joins the worker threads."""
        loop = asyncio.get_running_loop()
        watches = [
            ServiceWatch(namespace, service, self._api, self._forwarder(loop, targets), self._settings)
            for (namespace, service), targets in sorted(self._targets.items())
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
            await loop.create_future()  # until cancelled
        finally:
            self._active = False  # results already queued to the loop are dropped
            await self._stop(watches)
            logging.getLogger(URLLIB3_POOL_LOGGER).removeFilter(quiet)
            if not any(thread.is_alive() for thread in self._threads):
                self._client.close()  # idle connections only; a later run() opens new ones

    def _forwarder(self, loop: asyncio.AbstractEventLoop, targets: list[Target]) -> Callable[[Slices], None]:
        def on_slices(slices: Slices) -> None:  # on the worker thread
            found = {model: merge_endpoints(slices.values(), port) for model, port in targets}
            with contextlib.suppress(RuntimeError):  # the loop is closed: we are shutting down
                loop.call_soon_threadsafe(self._publish, found)

        return on_slices

    async def _stop(self, watches: list[ServiceWatch]) -> None:
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

    def _publish(self, found: dict[str, frozenset[Endpoint]]) -> None:
        """On the loop: update models whose endpoints changed, confirm the others."""
        if not self._active:
            return
        for model, endpoints in found.items():
            if self._published.get(model) != endpoints:
                self._published[model] = endpoints
                self._store.update(model, endpoints)
                log.info("model %s: %d ready endpoint(s) from EndpointSlices", model, len(endpoints))
            else:
                self._store.confirm(model)
