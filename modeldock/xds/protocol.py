"""The ADS state-of-the-world protocol state machine, one instance per stream.

No gRPC here: `on_request` and `on_change` take plain messages and return the
responses to send, so the protocol is tested through a fake stream.

Rules (xDS protocol, as Envoy 1.40 behaves):
- A request whose `response_nonce` is not the last nonce sent for its type is
  stale and ignored.
- A request echoing the last nonce is an ACK, or a NACK when it carries
  `error_detail`; a NACKed version is not sent again, only a newer one.
- One response per type is outstanding at a time; changes that arrive while
  waiting for an ACK are sent once the ACK comes.
- Cluster and Listener responses carry every resource; other types carry only
  resources that changed for this client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from envoy.service.discovery.v3 import discovery_pb2

from modeldock.xds.cache import ResourceCache
from modeldock.xds.resources import CLUSTER_TYPE, LISTENER_TYPE

log = logging.getLogger("modeldock.xds")

WILDCARD_TYPES = frozenset({CLUSTER_TYPE, LISTENER_TYPE})


@dataclass
class _Pending:
    nonce: str
    version: str
    sent: dict[str, str]  # name -> resource version


@dataclass
class _TypeState:
    wildcard: bool = False
    names: frozenset[str] = frozenset()
    acked: dict[str, str] = field(default_factory=dict)
    acked_version: str = ""
    pending: _Pending | None = None
    rejected_version: str | None = None


class StreamEvents:
    """Hooks for metrics; the default does nothing."""

    def pushed(self, type_url: str, count: int) -> None: ...

    def acked(self, type_url: str, version: str) -> None: ...

    def nacked(self, type_url: str, version: str, detail: str) -> None: ...


class StreamBase:
    """What every ADS stream state machine shares: the cache, the peer, nonces."""

    def __init__(
        self,
        cache: ResourceCache,
        *,
        peer: str = "",
        events: StreamEvents | None = None,
        nonce_factory: Callable[[], str] | None = None,
    ) -> None:
        self._cache = cache
        self.peer = peer
        self.node_id = ""
        self._events = events or StreamEvents()
        self._counter = 0
        self._nonce_factory = nonce_factory or self._next_nonce

    def _next_nonce(self) -> str:
        self._counter += 1
        return str(self._counter)

    def _note_node(self, request: discovery_pb2.DiscoveryRequest | discovery_pb2.DeltaDiscoveryRequest) -> None:
        if request.HasField("node") and request.node.id:
            self.node_id = request.node.id


class SotwStream(StreamBase):
    def __init__(self, cache: ResourceCache, **kwargs: object) -> None:
        super().__init__(cache, **kwargs)  # type: ignore[arg-type]
        self._types: dict[str, _TypeState] = {}

    def on_request(self, request: discovery_pb2.DiscoveryRequest) -> list[discovery_pb2.DiscoveryResponse]:
        self._note_node(request)
        type_url = request.type_url
        if not type_url:
            return []
        state = self._types.get(type_url)
        force = False
        if request.response_nonce:
            if state is None or state.pending is None or request.response_nonce != state.pending.nonce:
                return []  # stale: a newer response is on its way to the client
            pending = state.pending
            state.pending = None
            if request.HasField("error_detail"):
                state.rejected_version = pending.version
                self._events.nacked(type_url, pending.version, request.error_detail.message)
                log.warning(
                    "NACK from %s for %s version %s: %s",
                    self.node_id or self.peer,
                    type_url.rsplit(".", 1)[-1],
                    pending.version,
                    request.error_detail.message,
                )
            else:
                state.acked.update(pending.sent)
                state.acked_version = pending.version
                state.rejected_version = None
                self._events.acked(type_url, pending.version)
        else:
            if state is None:
                state = self._types[type_url] = _TypeState()
            # A first request on this stream (or a re-request): answer it in full.
            state.acked = {}
            state.acked_version = ""
            force = True
        names = frozenset(request.resource_names)
        wildcard = type_url in WILDCARD_TYPES and (not names or "*" in names)
        if wildcard != state.wildcard or names != state.names:
            force = force or bool(names - state.names) or wildcard != state.wildcard
            for gone in state.names - names:
                state.acked.pop(gone, None)
            state.wildcard, state.names = wildcard, names
        return self._maybe_send(type_url, state, force)

    def on_change(self) -> list[discovery_pb2.DiscoveryResponse]:
        out: list[discovery_pb2.DiscoveryResponse] = []
        for type_url, state in self._types.items():
            out.extend(self._maybe_send(type_url, state, False))
        return out

    def _maybe_send(self, type_url: str, state: _TypeState, force: bool) -> list[discovery_pb2.DiscoveryResponse]:
        if state.pending is not None:
            return []  # wait for the ACK; on_request re-evaluates then
        # Memoized per ResourceSet: every stream with this subscription shares it.
        selected, version = self._cache.current.select(type_url, None if state.wildcard else state.names)
        if version == state.rejected_version:
            return []
        if not force and version == state.acked_version:
            # The client ACKed exactly this selection (the version hashes every name and
            # resource version), so nothing differs: skip the per-resource comparison.
            return []
        if type_url in WILDCARD_TYPES:
            to_send = selected
        else:
            to_send = {n: r for n, r in selected.items() if state.acked.get(n) != r.version}
            if not to_send:
                return []
        nonce = self._nonce_factory()
        response = discovery_pb2.DiscoveryResponse(
            version_info=version,
            type_url=type_url,
            nonce=nonce,
            resources=[r.packed for r in to_send.values()],
        )
        state.pending = _Pending(nonce, version, {n: r.version for n, r in to_send.items()})
        self._events.pushed(type_url, len(to_send))
        return [response]
