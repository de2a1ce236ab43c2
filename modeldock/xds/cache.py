"""Versioned resource sets, swapped atomically.

A `ResourceSet` is immutable: type URL -> name -> (content hash, packed Any).
Versions are content hashes, so they are stable across restarts and identical
on every replica that sees the same state.

Sets are built incrementally: `ResourceSet.derive` makes a new set from the one
before and only what changed, reusing every other `Resource` object (and its
packed bytes) as it is, and records which names changed. A type's version is a
sum of per-resource digests, so replacing one resource updates it in O(1), not
O(resources). `ResourceCache` keeps a short log of those changes, so a stream
can ask what changed since the set it last compared against instead of
comparing every resource again.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from google.protobuf import any_pb2
from google.protobuf.message import Message

_MASK = (1 << 64) - 1


def _mix(name: str, version: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{name}\0{version}".encode()).digest()[:8], "big")


@dataclass(frozen=True)
class Resource:
    name: str
    version: str  # content hash
    packed: any_pb2.Any
    # This resource's share of its type's version: a digest of (name, version).
    mix: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mix", _mix(self.name, self.version))


def pack(name: str, message: Message) -> Resource:
    packed = any_pb2.Any()
    packed.Pack(message)
    # Deterministic serialisation makes the hash a function of content alone.
    digest = hashlib.sha256(message.SerializeToString(deterministic=True)).hexdigest()[:16]
    return Resource(name, digest, packed)


def _version(total: int) -> str:
    return f"{total & _MASK:016x}"


def type_version(resources: Mapping[str, Resource]) -> str:
    """The version of a group of resources: the sum of their (name, version) digests, mod 2**64.

    Order-independent, so a change of one resource moves it by that resource's
    digests alone (`ResourceSet.derive`), and equal content always has an equal version.
    """
    return _version(sum(r.mix for r in resources.values()))


Selection = tuple[Mapping[str, Resource], str]
_Key = tuple[str, frozenset[str] | None]
_MAX_SELECTIONS = 64  # distinct subscriptions memoized per set; Envoys share one or two
_EMPTY: Mapping[str, Resource] = MappingProxyType({})
_NO_CHANGES: Mapping[str, frozenset[str]] = MappingProxyType({})
_serials = itertools.count(1)


@dataclass(frozen=True)
class _Chosen:
    resources: Mapping[str, Resource]
    version: str
    total: int


@dataclass(frozen=True)
class ResourceSet:
    by_type: Mapping[str, Mapping[str, Resource]]
    versions: Mapping[str, str]
    # Every set has its own serial; `base` is the serial of the set it was derived
    # from, `changed` the names of each type added, replaced or removed since then.
    serial: int = field(default_factory=lambda: next(_serials), compare=False)
    base: int | None = field(default=None, compare=False)
    changed: Mapping[str, frozenset[str]] = field(default_factory=lambda: _NO_CHANGES, compare=False, repr=False)
    _totals: Mapping[str, int] = field(default_factory=dict, compare=False, repr=False)
    _selections: dict[_Key, _Chosen] = field(default_factory=dict, compare=False, repr=False)
    # The base's selections, brought up to date on first use (`select`).
    _inherited: Mapping[_Key, _Chosen] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, by_type: Mapping[str, Mapping[str, Resource]]) -> ResourceSet:
        frozen = {t: MappingProxyType(dict(r)) for t, r in by_type.items()}
        totals = {t: sum(r.mix for r in resources.values()) for t, resources in frozen.items()}
        return cls(MappingProxyType(frozen), MappingProxyType({t: _version(v) for t, v in totals.items()}),
                   _totals=totals)

    @classmethod
    def derive(
        cls,
        base: ResourceSet,
        updates: Mapping[str, Mapping[str, Resource]],
        removed: Mapping[str, Iterable[str]] | None = None,
    ) -> ResourceSet:
        """`base` with `updates` put in and `removed` taken out; `base` itself when nothing differs.

        Costs O(changes) apart from one dict copy per changed type. A resource whose
        version equals the one in `base` is no change: `base`'s object stays.
        """
        removed = removed or {}
        by_type = dict(base.by_type)
        totals = dict(base._totals)
        changed: dict[str, frozenset[str]] = {}
        for type_url in {*updates, *removed}:
            before = base.of(type_url)
            after: dict[str, Resource] | None = None
            total = totals.get(type_url, 0)
            names: list[str] = []
            for name, resource in updates.get(type_url, {}).items():
                old = before.get(name)
                if old is not None and old.version == resource.version:
                    continue
                after = dict(before) if after is None else after
                after[name] = resource
                total += resource.mix - (old.mix if old is not None else 0)
                names.append(name)
            for name in removed.get(type_url, ()):
                old = before.get(name)
                if old is None:
                    continue
                after = dict(before) if after is None else after
                del after[name]
                total -= old.mix
                names.append(name)
            if after is not None:
                by_type[type_url] = MappingProxyType(after)
                totals[type_url] = total
                changed[type_url] = frozenset(names)
            elif type_url not in by_type:
                by_type[type_url] = _EMPTY  # a type named but empty exists, as in `build`
                totals[type_url] = 0
                changed[type_url] = frozenset()
        if not changed:
            return base
        versions = dict(base.versions)
        versions.update({t: _version(totals[t]) for t in changed})
        return cls(MappingProxyType(by_type), MappingProxyType(versions), base=base.serial,
                   changed=MappingProxyType(changed), _totals=totals, _inherited=dict(base._selections))

    def of(self, type_url: str) -> Mapping[str, Resource]:
        return self.by_type.get(type_url, _EMPTY)

    def select(self, type_url: str, names: frozenset[str] | None) -> Selection:
        """The resources a subscription sees (`names` None: all of the type) and their version.

        Every stream with the same subscription asks the same after each change,
        so the answer is computed once per set, and from the base set's answer
        and the changed names when the base had one.
        """
        available = self.of(type_url)
        if names is None:
            return available, self.versions.get(type_url) or type_version(available)
        key = (type_url, names)
        found = self._selections.get(key)
        if found is None:
            found = self._choose(type_url, names, available)
            if len(self._selections) < _MAX_SELECTIONS:
                self._selections[key] = found
        return found.resources, found.version

    def _choose(self, type_url: str, names: frozenset[str], available: Mapping[str, Resource]) -> _Chosen:
        inherited = self._inherited.get((type_url, names))
        if inherited is not None:
            touched = self.changed.get(type_url, frozenset()) & names
            if not touched:
                return inherited
            chosen = dict(inherited.resources)
            total = inherited.total
            for name in touched:
                old = chosen.pop(name, None)
                new = available.get(name)
                total += (new.mix if new is not None else 0) - (old.mix if old is not None else 0)
                if new is not None:
                    chosen[name] = new
            return _Chosen(MappingProxyType(chosen), _version(total), total)
        picked = {name: available[name] for name in names if name in available}
        total = sum(r.mix for r in picked.values())
        return _Chosen(MappingProxyType(picked), _version(total), total)


class ResourceCache:
    """Holds the current ResourceSet and tells subscribers when it changes.

    It also logs, for the last `history` swaps, which names changed (when the
    new set was derived from the current one): `changed_since`.
    """

    def __init__(self, history: int = 256) -> None:
        self._current = ResourceSet.build({})
        self._listeners: set[Callable[[], None]] = set()
        self._history = history
        self._log: deque[tuple[int, Mapping[str, frozenset[str]]]] = deque()
        self._floor = self._current.serial  # every change after this set is in the log

    @property
    def current(self) -> ResourceSet:
        return self._current

    def set(self, resources: ResourceSet) -> bool:
        """Swap in a new set; returns whether anything changed."""
        current = self._current
        if resources is current or (
            resources.versions == current.versions and set(resources.by_type) == set(current.by_type)
        ):
            return False
        if resources.base == current.serial:
            self._log.append((resources.serial, resources.changed))
            if len(self._log) > self._history:
                self._floor = self._log.popleft()[0]
        else:  # not derived from the current set: what changed is unknown
            self._log.clear()
            self._floor = resources.serial
        self._current = resources
        for listener in list(self._listeners):
            listener()
        return True

    def changed_since(self, type_url: str, serial: int) -> frozenset[str] | None:
        """Names of `type_url` added, replaced or removed since set `serial` was current.

        None when that is not known (the set is older than the log, or a set not
        derived from its predecessor came between): compare everything.
        """
        if serial == self._current.serial:
            return frozenset()
        if serial < self._floor:
            return None
        names: set[str] = set()
        for entry_serial, changed in reversed(self._log):
            if entry_serial <= serial:
                break
            names.update(changed.get(type_url, ()))
        return frozenset(names)

    def add_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.add(listener)

    def remove_listener(self, listener: Callable[[], None]) -> None:
        self._listeners.discard(listener)
