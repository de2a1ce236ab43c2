"""Versioned resource sets, swapped atomically.

A `ResourceSet` is immutable: type URL -> name -> (content hash, packed Any).
Versions are content hashes, so they are stable across restarts and identical
on every replica that sees the same state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from google.protobuf import any_pb2
from google.protobuf.message import Message


@dataclass(frozen=True)
class Resource:
    name: str
    version: str  # content hash
    packed: any_pb2.Any


def pack(name: str, message: Message) -> Resource:
    packed = any_pb2.Any()
    packed.Pack(message)
    # Deterministic serialisation makes the hash a function of content alone.
    digest = hashlib.sha256(message.SerializeToString(deterministic=True)).hexdigest()[:16]
    return Resource(name, digest, packed)


def type_version(resources: Mapping[str, Resource]) -> str:
    h = hashlib.sha256()
    for name in sorted(resources):
        h.update(name.encode())
        h.update(b"\0")
        h.update(resources[name].version.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class ResourceSet:
    by_type: Mapping[str, Mapping[str, Resource]]
    versions: Mapping[str, str]

    @classmethod
    def build(cls, by_type: Mapping[str, Mapping[str, Resource]]) -> ResourceSet:
        frozen = {t: MappingProxyType(dict(r)) for t, r in by_type.items()}
        return cls(MappingProxyType(frozen), MappingProxyType({t: type_version(r) for t, r in frozen.items()}))

    def of(self, type_url: str) -> Mapping[str, Resource]:
        return self.by_type.get(type_url, MappingProxyType({}))


class ResourceCache:
    """Holds the current ResourceSet and tells subscribers when it changes."""

    def __init__(self) -> None:
        self._current = ResourceSet.build({})
        self._listeners: set[Callable[[], None]] = set()

    @property
    def current(self) -> ResourceSet:
        return self._current

    def set(self, resources: ResourceSet) -> bool:
        """Swap in a new set; returns whether anything changed."""
        if resources.versions == self._current.versions and set(resources.by_type) == set(self._current.by_type):
            return False
        self._current = resources
        for listener in list(self._listeners):
            listener()
        return True

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.add(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.discard(listener)
