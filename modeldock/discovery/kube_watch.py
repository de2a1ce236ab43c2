"""List then watch the EndpointSlices of one Service, on a worker thread.

The official client is synchronous (urllib3), so each (namespace, service)
gets a thread running `ServiceWatch.run`. It keeps the Service's slices by
name and hands a copy to `on_slices` after every successful list, every
watch event (bookmarks included) and every clean end of a watch, so a healthy
quiet watch keeps confirming at least once per `watch_timeout_seconds`.

Watches carry `timeoutSeconds`, so the server ends them regularly and they
resume from the last resourceVersion seen (bookmarks move it on too). A 410
Gone (resourceVersion expired) re-lists at once; any other failure re-lists
after a capped exponential backoff. A failure streak is logged once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kubernetes.client import ApiException, DiscoveryV1Api, V1EndpointSlice
from kubernetes.watch import Watch

log = logging.getLogger("modeldock.discovery")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
THREAD_PREFIX = "modeldock-kube"
URLLIB3_POOL_LOGGER = "urllib3.connectionpool"

Slices = dict[str, V1EndpointSlice]


@dataclass(frozen=True)
class WatchSettings:
    watch_timeout_seconds: int = 60  # the server ends each watch after this; we resume it
    request_timeout_seconds: float = 10.0  # connect and list; the slack on a watch's read timeout
    backoff_base_seconds: float = 0.2
    backoff_max_seconds: float = 5.0

    def backoff(self, failures: int) -> float:
        return min(self.backoff_max_seconds, self.backoff_base_seconds * 2.0 ** max(0, failures - 1))


class ServiceWatch:
    """The list/watch loop of one Service. `run` is a thread body; `stop` may be called from any thread."""

    def __init__(
        self,
        namespace: str,
        service: str,
        api: DiscoveryV1Api,
        on_slices: Callable[[Slices], None],
        settings: WatchSettings,
    ) -> None:
        self.namespace = namespace
        self.service = service
        self._api = api
        self._on_slices = on_slices
        self._settings = settings
        self._selector = f"{SERVICE_NAME_LABEL}={service}"
        self._stopping = threading.Event()
        self._watch = Watch()
        self._failures = 0
        self._warned = False

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.service}"

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        """Ask `run` to return; closes the watch connection if one is open.

        A watch that was still connecting misses this, so callers repeat it
        until the thread has exited.
        """
        self._stopping.set()
        self._watch.stop()

    def run(self) -> None:
        while not self.stopping:
            try:
                self._list_and_watch()
            except Exception as exc:  # every failure means: list again
                if self.stopping:
                    break
                self._failures += 1
                self._stopping.wait(self._after_failure(exc))

    def _after_failure(self, exc: Exception) -> float:
        """Log (once per streak) and return how long to wait before listing again."""
        expired = isinstance(exc, ApiException) and exc.status == 410
        if expired and self._failures == 1:
            # Normal after a long disconnect or compaction: re-list right away.
            log.info("EndpointSlices %s: resourceVersion expired (410); listing again", self.name)
            return 0.0
        if not self._warned:
            self._warned = True
            log.warning(
                "EndpointSlices %s: list/watch failed, retrying with backoff up to %gs: %s",
                self.name,
                self._settings.backoff_max_seconds,
                describe(exc),
            )
        else:
            log.debug("EndpointSlices %s: failure %d: %s", self.name, self._failures, describe(exc))
        return self._settings.backoff(self._failures)

    def _healthy(self) -> None:
        if self._warned:
            log.info("EndpointSlices %s: watching again after %d failures", self.name, self._failures)
        self._failures = 0
        self._warned = False

    def _list_and_watch(self) -> None:
        settings = self._settings
        listing = self._api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=self._selector,
            _request_timeout=(settings.request_timeout_seconds, settings.request_timeout_seconds),
        )
        slices: Slices = {slice_name(item): item for item in listing.items}
        self._emit(slices)
        version = listing.metadata.resource_version if listing.metadata else None
        while not self.stopping:
            for event in self._watch.stream(
                self._api.list_namespaced_endpoint_slice,
                self.namespace,
                label_selector=self._selector,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=settings.watch_timeout_seconds,
                # The server ends the watch on time; the read timeout only catches a dead connection.
                _request_timeout=(
                    settings.request_timeout_seconds,
                    settings.watch_timeout_seconds + settings.request_timeout_seconds,
                ),
            ):
                if self.stopping:
                    return
                if not apply_event(slices, event["type"], event["object"]):
                    continue
                self._healthy()
                self._emit(slices)
            # A clean end (the server's timeoutSeconds) means every change up
            # to now was delivered: that vouches for the list like a bookmark.
            version = self._watch.resource_version or version
            self._healthy()
            self._emit(slices)

    def _emit(self, slices: Slices) -> None:
        if not self.stopping:
            self._on_slices(dict(slices))


class QuietRetries(logging.Filter):
    """Drops urllib3's per-retry warnings on our threads: we log once per failure streak.

    urllib3 still retries (a stale keep-alive connection deserves one); only
    the noise goes. Other threads' records pass untouched.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            str(record.msg).startswith("Retrying") and threading.current_thread().name.startswith(THREAD_PREFIX)
        )


def apply_event(slices: Slices, kind: str, obj: object) -> bool:
    """Apply one watch event to `slices`; False for an event type we do not know."""
    if kind in ("ADDED", "MODIFIED") and isinstance(obj, V1EndpointSlice):
        slices[slice_name(obj)] = obj
    elif kind == "DELETED" and isinstance(obj, V1EndpointSlice):
        slices.pop(slice_name(obj), None)
    elif kind != "BOOKMARK":  # a bookmark changes nothing but still vouches for the list
        log.debug("ignoring watch event %r", kind)
        return False
    return True


def slice_name(endpoint_slice: V1EndpointSlice) -> str:
    meta = endpoint_slice.metadata
    return (meta.name if meta else None) or ""


def describe(exc: Exception) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"
