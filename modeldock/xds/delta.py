"""The ADS delta (incremental) protocol state machine, one instance per stream.

No gRPC here, like `protocol.SotwStream`: `on_request` and `on_change` take
plain messages and return the responses to send.

Rules (xDS incremental protocol, as Envoy 1.40 behaves):
- Subscriptions are per type. The first request for Cluster or Listener with
  no names is a wildcard subscription ("legacy wildcard"); `*` in
  `resource_names_subscribe` subscribes to everything, in
  `resource_names_unsubscribe` ends that.
- Per-resource versions are the content hashes in `Resource.version`. The
  stream tracks which version the client holds of each resource: what the
  first request lists in `initial_resource_versions` (a reconnect), then what
  it ACKs. Only resources whose version differs are sent; a resource the
  client holds that is gone goes into `removed_resources`.
- A request echoing the nonce of the outstanding response is an ACK, or a NACK
  when it carries `error_detail`. A NACKed resource version is not sent again,
  only a newer one. Any other nonce is stale: not an ACK, but the subscription
  changes it carries still apply, since they are diffs and would be lost.
- One response per type is outstanding at a time; what changes meanwhile is
  sent once the ACK comes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from envoy.service.discovery.v3 import discovery_pb2

from modeldock.xds.cache import ResourceCache
from modeldock.xds.protocol import WILDCARD_TYPES, StreamBase

log = logging.getLogger("modeldock.xds")

WILDCARD = "*"
# The client holds some version of the resource, but which one is unknown (after
# a NACK, Envoy may have applied part of the response): any good version is sent.
UNKNOWN = ""


@dataclass
class _Pending:
    nonce: str
    system_version: str
    sent: dict[str, str | None]  # name -> version sent; None for a removal


@dataclass
class _TypeState:
    wildcard: bool = False
    names: frozenset[str] = frozenset()  # frozen: the key of the memoized selection
    known: dict[str, str] = field(default_factory=dict)  # name -> version the client holds
    rejected: dict[str, str] = field(default_factory=dict)  # name -> version the client NACKed
    pending: _Pending | None = None
    # A wildcard subscription gets an answer even when it is empty, so that
    # Envoy's initial fetch completes.
    owes_answer: bool = False
    # The serial of the set last compared in full against `known` (None: compare all next time),
    # and the names this stream must look at again since (subscribed again). A NACKed name needs
    # no mark: only a version changed since, so one in the cache's log, is sent again.
    checked: int | None = None
    dirty: set[str] = field(default_factory=set)

    def wants(self, name: str) -> bool:
        return self.wildcard or name in self.names


class DeltaStream(StreamBase):
    def __init__(self, cache: ResourceCache, **kwargs: object) -> None:
        super().__init__(cache, **kwargs)  # type: ignore[arg-type]
        self._types: dict[str, _TypeState] = {}

    def on_request(self, request: discovery_pb2.DeltaDiscoveryRequest) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        self._note_node(request)
        type_url = request.type_url
        if not type_url:
            return []
        state = self._types.get(type_url)
        if state is None:
            state = self._types[type_url] = self._first(type_url, request)
        else:
            if request.response_nonce:
                self._settle(type_url, state, request)
            self._resubscribe(state, request.resource_names_subscribe)
        self._unsubscribe(state, request.resource_names_unsubscribe)
        return self._maybe_send(type_url, state)

    def on_change(self) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        out: list[discovery_pb2.DeltaDiscoveryResponse] = []
        for type_url, state in self._types.items():
            out.extend(self._maybe_send(type_url, state))
        return out

    # ---- requests ---------------------------------------------------------

    @staticmethod
    def _first(type_url: str, request: discovery_pb2.DeltaDiscoveryRequest) -> _TypeState:
        names = frozenset(request.resource_names_subscribe)
        wildcard = WILDCARD in names or (type_url in WILDCARD_TYPES and not names)
        state = _TypeState(wildcard=wildcard, names=names - {WILDCARD}, owes_answer=wildcard)
        # A reconnecting client says what it holds; those versions are not resent.
        state.known = {n: v for n, v in request.initial_resource_versions.items() if state.wants(n)}
        return state

    def _settle(self, type_url: str, state: _TypeState, request: discovery_pb2.DeltaDiscoveryRequest) -> None:
        pending = state.pending
        if pending is None or request.response_nonce != pending.nonce:
            return  # stale: not an ACK of anything outstanding
        state.pending = None
        if request.HasField("error_detail"):
            for name, version in pending.sent.items():
                if version is None:
                    state.known.pop(name, None)
                elif state.wants(name):
                    state.rejected[name] = version
                    state.known[name] = UNKNOWN
            self._events.nacked(type_url, pending.system_version, request.error_detail.message)
            log.warning(
                "delta NACK from %s for %s (%d resources): %s",
                self.node_id or self.peer, type_url.rsplit(".", 1)[-1], len(pending.sent),
                request.error_detail.message,
            )
            return
        for name, version in pending.sent.items():
            if version is None:
                state.known.pop(name, None)
            elif state.wants(name):  # not unsubscribed while the response was in flight
                state.known[name] = version
                state.rejected.pop(name, None)
        self._events.acked(type_url, pending.system_version)

    @staticmethod
    def _resubscribe(state: _TypeState, names: Iterable[str]) -> None:
        added = set(names)
        if WILDCARD in added:
            state.wildcard = True
            state.checked = None  # every name is wanted now
            added.discard(WILDCARD)
        if added:
            state.names = state.names | added
            state.dirty.update(added)
        for name in added:
            state.known.pop(name, None)  # an explicit subscribe asks for the resource again, even if held

    @staticmethod
    def _unsubscribe(state: _TypeState, names: Iterable[str]) -> None:
        dropped = set(names)
        if not dropped:
            return
        if WILDCARD in dropped:
            state.wildcard = False
            dropped.discard(WILDCARD)
        if dropped:
            state.names = state.names - dropped
        for name in dropped:
            if state.wildcard and name in state.known:
                # Still wanted through the wildcard, but the client may have dropped
                # it: mark unknown so it is sent again (or removed, if gone).
                state.known[name] = UNKNOWN
                state.dirty.add(name)
        for name in [n for n in state.known if not state.wants(n)]:
            del state.known[name]  # the client forgets these itself: no removal is owed

    # ---- responses --------------------------------------------------------

    def _maybe_send(self, type_url: str, state: _TypeState) -> list[discovery_pb2.DeltaDiscoveryResponse]:
        if state.pending is not None:
            return []  # wait for the ACK; on_request re-evaluates then
        current = self._cache.current
        # Memoized per ResourceSet: every stream with this subscription shares it.
        selected, system_version = current.select(type_url, None if state.wildcard else state.names)
        # What to compare: since the set last compared, only the names the cache logged as
        # changed and those this stream touched (O(changes)); everything when that is unknown.
        changed = None if state.checked is None else self._cache.changed_since(type_url, state.checked)
        if changed is None:
            updates = [
                r for name, r in selected.items()
                if state.known.get(name) != r.version and state.rejected.get(name) != r.version
            ]
            removed = [name for name in state.known if name not in selected]
        else:
            updates, removed = [], []
            for name in changed | state.dirty if state.dirty else changed:
                r = selected.get(name)
                if r is None:
                    if name in state.known:
                        removed.append(name)
                elif state.known.get(name) != r.version and state.rejected.get(name) != r.version:
                    updates.append(r)
        state.checked = current.serial
        state.dirty.clear()
        if not updates and not removed and not state.owes_answer:
            return []
        state.owes_answer = False
        nonce = self._nonce_factory()
        response = discovery_pb2.DeltaDiscoveryResponse(
            system_version_info=system_version,
            type_url=type_url,
            nonce=nonce,
            resources=[discovery_pb2.Resource(name=r.name, version=r.version, resource=r.packed) for r in updates],
            removed_resources=removed,
        )
        sent: dict[str, str | None] = {r.name: r.version for r in updates}
        sent.update(dict.fromkeys(removed))
        state.pending = _Pending(nonce, system_version, sent)
        self._events.pushed(type_url, len(updates))
        return [response]
