"""One replica's standing, as its peers receive it (flowcontrol/README "Across replicas").

Times are relative (seconds ago, seconds left, at the moment of export): replicas' monotonic
clocks differ. Keyed by field name, as `sharing.records.ReplicaShare`, so a replica of the next
version with a field more is still read during a rolling upgrade."""

from __future__ import annotations

import msgspec


class ClassSeen(msgspec.Struct, frozen=True):
    priority: int
    ago: float  # seconds since a request of this class was last seen


class TenantStanding(msgspec.Struct, frozen=True):
    tenant: str
    weight: float
    active_for: float  # seconds it stays active on the exporting replica (0: only its served part is held there)
    served: float  # its recently served tokens there, decayed to the export


class ModelStanding(msgspec.Struct, frozen=True):
    model: str
    classes: tuple[ClassSeen, ...] = ()
    tenants: tuple[TenantStanding, ...] = ()
    served_total: float = 0.0  # all its tenants' served tokens, decayed to the export
    kept: int | None = None  # the largest recent protected cost there (None: none seen)
