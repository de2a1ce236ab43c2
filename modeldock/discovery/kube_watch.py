"""List, then watch, one namespace's EndpointSlices, on a worker thread (an informer's reflector).

The official client is synchronous (urllib3), so each namespace gets a thread
running `NamespaceWatch.run`: one list, then one watch at a time, both with
the label selector `kubernetes.io/service-name` ("has the label"), so slices
that belong to no Service are never downloaded. What arrives goes to a
`WatchHandler`: `listed` after every list, `changed` per watch event, `synced`
when the server vouched for everything so far (a bookmark, a clean end).

Watches ask for bookmarks and carry `timeoutSeconds`, so the server ends them
regularly; the next one resumes from the last resourceVersion seen, and a
resync downloads nothing that did not change. A 410 Gone (that version was
compacted away) re-lists at once. Any other failure waits a capped
exponential backoff, then resumes the watch from the last version (a failed
list lists again); the first watch after a failure asks the server to end it
within `recovery_watch_seconds`, so its clean end vouches for the cache soon
without a re-list. A failure streak is logged once.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Protocol

from kubernetes.client import ApiException, DiscoveryV1Api, V1EndpointSlice
from kubernetes.watch import Watch

from modeldock.discovery.kube_cache import SERVICE_NAME_LABEL

log = logging.getLogger("modeldock.discovery")

THREAD_PREFIX = "modeldock-kube"
URLLIB3_POOL_LOGGER = "urllib3.connectionpool"


@dataclass(frozen=True)
class WatchSettings:
    watch_timeout_seconds: int = 60  # the server ends each watch after this; we resume it
    request_timeout_seconds: float = 10.0  # connect and list; the slack on a watch's read timeout
    backoff_base_seconds: float = 0.2
    backoff_max_seconds: float = 5.0
    recovery_watch_seconds: int = 1  # the first watch after a failure: its clean end confirms soon

    def backoff(self, failures: int) -> float:
        return min(self.backoff_max_seconds, self.backoff_base_seconds * 2.0 ** max(0, failures - 1))


class WatchHandler(Protocol):
    """Called on the watch thread, in the order the server sent things."""

    def listed(self, items: list[V1EndpointSlice]) -> None: ...

    def changed(self, kind: str, obj: object) -> bool:
        """One watch event (bookmarks included); False for a type it does not know."""
        ...

    def synced(self) -> None:
        """A clean end of a watch: every change up to now was delivered."""
        ...


class NamespaceWatch:
    """The list/watch loop of one namespace. `run` is a thread body; `stop` may be called from any thread."""

    def __init__(self, namespace: str, api: DiscoveryV1Api, handler: WatchHandler, settings: WatchSettings) -> None:
        self.namespace = namespace
        self._api = api
        self._handler = handler
        self._settings = settings
        self._stopping = threading.Event()
        self._watch = Watch()
        self._must_list = True
        self._version: str | None = None  # where the next watch resumes
        self._failures = 0
        self._warned = False
        self._expired = False  # this streak already re-listed at once after a 410
        self._recovering = False

    @property
    def name(self) -> str:
        return self.namespace

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
                if self._must_list:
                    self._list()
                self._watch_once()
            except Exception as exc:  # every failure means: try again, from where we are
                if self.stopping:
                    break
                self._failures += 1
                self._recovering = True
                self._stopping.wait(self._after_failure(exc))

    def _after_failure(self, exc: Exception) -> float:
        """Log (once per streak) and return how long to wait before trying again."""
        if isinstance(exc, ApiException) and exc.status == 410:
            self._must_list = True  # what we hold is too old to resume from
            if not self._expired:
                # Normal after a long disconnect or compaction: re-list right away, once.
                self._expired = True
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
        self._expired = False

    def _list(self) -> None:
        settings = self._settings
        listing = self._api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=SERVICE_NAME_LABEL,
            _request_timeout=(settings.request_timeout_seconds, settings.request_timeout_seconds),
        )
        if not self.stopping:
            self._handler.listed(list(listing.items))
        self._version = listing.metadata.resource_version if listing.metadata else None
        self._must_list = False
        self._recovering = False  # a list vouches for everything by itself

    def _watch_once(self) -> None:
        """One watch, from the last version; returns when the server ends it cleanly."""
        settings = self._settings
        seconds = settings.watch_timeout_seconds
        if self._recovering:
            seconds = min(seconds, settings.recovery_watch_seconds)
        for event in self._watch.stream(
            self._api.list_namespaced_endpoint_slice,
            self.namespace,
            label_selector=SERVICE_NAME_LABEL,
            resource_version=self._version,
            allow_watch_bookmarks=True,
            timeout_seconds=seconds,
            # The server ends the watch on time; the read timeout only catches a dead connection.
            _request_timeout=(settings.request_timeout_seconds, seconds + settings.request_timeout_seconds),
        ):
            if self.stopping:
                return
            known = self._handler.changed(event["type"], event["object"])
            # Only now, once the event is in the cache: a failure before this resumes before it.
            self._version = self._watch.resource_version or self._version
            if known:
                self._healthy()
        if self.stopping:
            return
        # A clean end (the server's timeoutSeconds) means every change up to
        # now was delivered: that vouches for the cache like a bookmark.
        self._recovering = False
        self._healthy()
        self._handler.synced()


class QuietRetries(logging.Filter):
    """Drops urllib3's per-retry warnings on our threads: we log once per failure streak.

    urllib3 still retries (a stale keep-alive connection deserves one); only
    the noise goes. Other threads' records pass untouched.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            str(record.msg).startswith("Retrying") and threading.current_thread().name.startswith(THREAD_PREFIX)
        )


def describe(exc: Exception) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"
