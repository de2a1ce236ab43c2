"""A request's standing on a model: protected, or must it leave headroom?

At a full endpoint the work-conserving queue would hand every slot that frees to whoever heads
the queue, so a request of the top class, or of a tenant under its share, that arrives next waits
for the next slot to free. Headroom keeps one free: a request must leave it (README "Overload")
when a class above its own was seen on the model within `window` seconds, or when its tenant
holds more of the model's in-flight tokens than weight / (sum of the weights of the tenants seen
within `window`) of them. Everything is O(1) per question (amortised; the class count is fixed
by the config): the active tenants' weight sum is kept as they come and expire.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from modeldock.clock import Clock


@dataclass
class _Model:
    classes: dict[int, float] = field(default_factory=dict)  # priority -> last seen (monotonic)
    tenants: dict[str, tuple[float, float]] = field(default_factory=dict)  # tenant -> (active until, weight)
    weights: float = 0.0  # sum of the active tenants' weights
    expiries: list[tuple[float, str]] = field(default_factory=list)  # (active until, tenant), lazily pruned


class Standing:
    def __init__(self, clock: Clock, window: float) -> None:
        if window <= 0:
            raise ValueError("standing window must be > 0")
        self._clock = clock
        self.window = window
        self._models: dict[str, _Model] = {}

    def seen(self, model: str, tenant: str, weight: float, priority: int) -> None:
        """A request of `tenant` (at `weight`) and class `priority` arrived for `model`."""
        now = self._clock.monotonic()
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = _Model()
        m.classes[priority] = now
        until = now + self.window
        before = m.tenants.get(tenant)
        m.weights += weight - (before[1] if before is not None else 0.0)
        m.tenants[tenant] = (until, weight)
        heapq.heappush(m.expiries, (until, tenant))
        if len(m.expiries) > 4 * len(m.tenants) + 64:  # refreshed entries pile up: keep only the live ones
            m.expiries = [(u, t) for t, (u, _) in m.tenants.items()]
            heapq.heapify(m.expiries)

    def active_weight(self, model: str) -> float:
        """Sum of the weights of the tenants seen on `model` within the window."""
        m = self._models.get(model)
        if m is None:
            return 0.0
        self._expire(m, self._clock.monotonic())
        return m.weights

    def must_leave_headroom(self, model: str, tenant: str, weight: float, priority: int,
                            tenant_tokens: int, model_tokens: int) -> bool:
        """True: a class above `priority` was seen within the window, or `tenant` holds more than
        its weighted share of the `model_tokens` in flight (`tenant_tokens` of them)."""
        m = self._models.get(model)
        if m is None:
            return False
        now = self._clock.monotonic()
        since = now - self.window
        for other, at in m.classes.items():
            if other > priority and at > since:
                return True
        if tenant_tokens <= 0:
            return False
        self._expire(m, now)
        total = m.weights
        if tenant not in m.tenants:
            total += weight
        return tenant_tokens * total > weight * model_tokens

    def contended(self, model: str, tenant: str, priority: int) -> bool:
        """Is anyone else on `model` within the window (a lower class, another tenant), whom the
        headroom keeps slots from? Then a protected request may take one past the queue."""
        m = self._models.get(model)
        if m is None:
            return False
        now = self._clock.monotonic()
        since = now - self.window
        if any(other < priority and at > since for other, at in m.classes.items()):
            return True
        self._expire(m, now)
        return len(m.tenants) > 1 or (len(m.tenants) == 1 and tenant not in m.tenants)

    @staticmethod
    def _expire(m: _Model, now: float) -> None:
        heap = m.expiries
        while heap and heap[0][0] <= now:
            until, tenant = heapq.heappop(heap)
            held = m.tenants.get(tenant)
            if held is not None and held[0] == until:
                del m.tenants[tenant]
                m.weights -= held[1]
        if not m.tenants:
            m.weights = 0.0  # no float drift left behind
