"""A request's standing on a model: protected, or must it leave headroom?

At a full endpoint the work-conserving queue would hand every slot that frees to whoever heads
the queue, so a request of the top class, or of a tenant under its share, that arrives next waits
for the next slot to free. Headroom keeps one free: a request must leave it (README "Overload")
when a class above its own was seen on the model within `window` seconds, or when its tenant was
recently served more of the model's tokens than weight / (sum of the weights of the tenants seen
within `window`) of them.

"Recently served" is the tokens of the requests dispatched to the model, decayed with time
constant `share_window`: a rate, as the fair queue counts. (Tokens in flight would not do: under
load every request lasts longer, and the tenant whose requests fit the room least -- the one
sending fewer, larger requests -- holds its tokens longest, so a tenant sending half its share
would look like one at its share.) The time constant is longer than `window`: Poisson arrivals
at half a tenant's share still bring a second's clump of twice its mean rate now and then, and a
2 s average read that clump as "over its share" (measured: the quiet tenant's clump flipped both
tenants' standing, and the flooding tenant's backlog took the room kept for the clump). A tenant
that becomes active starts at its weighted share of what was recently served (the others keep
their standing relative to one another): otherwise a newcomer whose tokens are not in the
average yet would look under its share -- protected -- for about `share_window` while it floods,
and a tenant that was alone would look over it. One that comes back starts at what it was served
before it left (decayed since) when that is less: a quiet tenant sending a burst now and then
stays protected. A tenant leaves the total when its window passes, and joins again when a
request of its is dispatched after that (it waited in the queue): none of the total belongs to
no one.

Across replicas (README "Across replicas"): `share()` exports this replica's own standing,
`apply_peers` replaces what the peers said; every question then combines the two. A tenant
active on a peer counts once in the weights and joins here without a start (it is not new); a
tenant leaving here while active on a peer keeps its served part here ("held") until it is
active nowhere, and then its peers' parts leave the total with it.

Everything is O(1) per question (amortised; the class count is fixed by the config): the active
tenants' weight sum is kept as they come and expire.

How much room to keep is sized to the protected requests themselves: `kept_tokens` is the largest
cost of the last `KEPT_SAMPLES` protected requests on the model, so the kept room fits every one of
them (a fixed share of the KV cache is smaller than many real requests, and a protected request
that does not fit waits for the next completion like everyone else: with the 90th percentile, one
protected request in ten did, which set their TTFT p95; the picker keeps at most half a cache).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from modeldock.clock import Clock
from modeldock.flowcontrol.standing_share import ClassSeen, ModelStanding, TenantStanding

KEPT_SAMPLES = 32  # protected requests' costs remembered per model


@dataclass
class _Model:
    classes: dict[int, float] = field(default_factory=dict)  # priority -> last seen (monotonic)
    tenants: dict[str, tuple[float, float]] = field(default_factory=dict)  # tenant -> (active until, weight)
    weights: float = 0.0  # sum of the active tenants' weights
    expiries: list[tuple[float, str]] = field(default_factory=list)  # (active until, tenant), lazily pruned
    costs: deque[int] = field(default_factory=lambda: deque(maxlen=KEPT_SAMPLES))  # protected requests' costs
    served: dict[str, tuple[float, float]] = field(default_factory=dict)  # tenant -> (decayed tokens, at)
    # Tenants no longer active: their served tokens when they left (outside the total), decaying on.
    gone: dict[str, tuple[float, float]] = field(default_factory=dict)
    served_total: tuple[float, float] = (0.0, 0.0)  # all tenants' (decayed tokens, at)
    kept: int | None = None  # the quantile of `costs`, computed when asked after a change
    stale_kept: bool = False
    # The peers' standing (apply_peers), on this replica's clock:
    peer_classes: dict[int, float] = field(default_factory=dict)  # priority -> last seen on a peer
    # tenant -> (active until on a peer, -inf: none; weight; served tokens on peers, at)
    peers: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)
    peer_heap: list[tuple[float, str]] = field(default_factory=list)  # (active until, tenant), lazily pruned
    peer_total: tuple[float, float] = (0.0, 0.0)
    peer_kept: int | None = None
    peer_only: int = 0  # tenants active on a peer and not here
    peer_only_weight: float = 0.0  # ...and their weights
    held: set[str] = field(default_factory=set)  # served here, not active here, active on a peer


class Standing:
    def __init__(self, clock: Clock, window: float, share_window: float | None = None) -> None:
        """`window`: how long a class or tenant counts as active after its last request;
        `share_window`: the time constant of the served-tokens average (default `window`)."""
        if window <= 0:
            raise ValueError("standing window must be > 0")
        if share_window is not None and share_window <= 0:
            raise ValueError("standing share_window must be > 0")
        self._clock = clock
        self.window = window
        self.share_window = share_window or window
        self._models: dict[str, _Model] = {}

    def seen(self, model: str, tenant: str, weight: float, priority: int) -> None:
        """A request of `tenant` (at `weight`) and class `priority` arrived for `model`."""
        now = self._clock.monotonic()
        m = self._model(model)
        m.classes[priority] = now
        self._activate(m, tenant, weight, now)

    def _activate(self, m: _Model, tenant: str, weight: float, now: float) -> None:
        """`tenant` is active for the next `window` (joining if it was not)."""
        self._expire(m, now)
        before = m.tenants.get(tenant)
        if before is None:
            p = m.peers.get(tenant) if m.peers else None
            if p is not None and p[0] > now:  # active on a peer: not a newcomer, now active here too
                m.peer_only -= 1
                m.peer_only_weight -= p[1]
                m.held.discard(tenant)
                m.served.setdefault(tenant, (0.0, now))
            else:
                self._joins(m, tenant, weight, now)
        m.weights += weight - (before[1] if before is not None else 0.0)
        until = now + self.window
        m.tenants[tenant] = (until, weight)
        heapq.heappush(m.expiries, (until, tenant))
        if len(m.expiries) > 4 * len(m.tenants) + 64:  # refreshed entries pile up: keep only the live ones
            m.expiries = [(u, t) for t, (u, _) in m.tenants.items()]
            heapq.heapify(m.expiries)

    def _joins(self, m: _Model, tenant: str, weight: float, now: float) -> None:
        """`tenant` becomes active: it starts at its weighted share of the recent total, or at what
        it was served before it left if that is less (a quiet tenant that comes back now and then
        stays protected); the total grows by as much, so every other tenant's standing relative to
        the rest is unchanged. The first after a quiet spell starts the total afresh."""
        total = self._decayed(m.served_total, now) - self._decayed(m.served.pop(tenant, None), now)
        weights = m.weights + m.peer_only_weight  # everyone active on any replica
        if weights <= 0.0:
            total = 0.0
            m.served.clear()  # inactive remainders (see `served`) belong to no one now
        everyone = total + (self._decayed(m.peer_total, now) if m.peers else 0.0)
        start = everyone * weight / weights if weights > 0.0 else 0.0
        earlier = m.gone.pop(tenant, None)
        if earlier is not None:
            start = min(start, self._decayed(earlier, now))
        m.served[tenant] = (start, now)
        m.served_total = (max(0.0, total) + start, now)

    def protected(self, model: str, cost: int) -> None:
        """A protected request of `cost` tokens went to `model`: what the kept room should fit.
        O(1); the quantile is computed only when an unprotected request asks for it."""
        m = self._model(model)
        m.costs.append(cost)
        m.stale_kept = True

    def kept_tokens(self, model: str) -> int | None:
        """The tokens to keep free per endpoint for protected requests: the largest of their recent
        costs on `model`; None before any was seen (the picker's default applies)."""
        m = self._models.get(model)
        if m is None:
            return None
        mine = self._local_kept(m)
        if m.peer_kept is None:
            return mine
        return m.peer_kept if mine is None else max(mine, m.peer_kept)

    def _local_kept(self, m: _Model) -> int | None:
        if not m.costs:
            return None
        if m.stale_kept:
            m.kept = max(m.costs)
            m.stale_kept = False
        return m.kept

    def active_weight(self, model: str) -> float:
        """Sum of the weights of the tenants seen on `model` within the window."""
        m = self._models.get(model)
        if m is None:
            return 0.0
        self._expire(m, self._clock.monotonic())
        return m.weights + m.peer_only_weight

    def served(self, model: str, tenant: str, tokens: int, weight: float) -> None:
        """A request of `tenant` (at `weight`) costing `tokens` was dispatched to `model` (sent to an
        endpoint). It makes the tenant active: one whose request waited in the queue longer than
        the window joins again, rather than stand outside the total as if protected."""
        m = self._model(model)
        now = self._clock.monotonic()
        self._expire(m, now)
        if tenant not in m.tenants:
            if self._peer_active(m, tenant, now):  # its window runs on a peer: served here, held
                m.held.add(tenant)
            else:
                self._activate(m, tenant, weight, now)
        m.served[tenant] = (self._decayed(m.served.get(tenant), now) + tokens, now)
        m.served_total = (self._decayed(m.served_total, now) + tokens, now)

    def served_tokens(self, model: str, tenant: str) -> float:
        """`tenant`'s recently served tokens on `model` (decayed to now)."""
        m = self._models.get(model)
        if m is None:
            return 0.0
        now = self._clock.monotonic()
        return self._decayed(m.served.get(tenant), now) + self._peer_served(m, tenant, now)

    def must_leave_headroom(self, model: str, tenant: str, weight: float, priority: int) -> bool:
        """True: a class above `priority` was seen within the window, or `tenant` was recently
        served more than its weighted share of the model's tokens."""
        m = self._models.get(model)
        if m is None:
            return False
        now = self._clock.monotonic()
        since = now - self.window
        for other, at in m.classes.items():
            if other > priority and at > since:
                return True
        if m.peer_classes:  # (the guards keep the path without peers as it was)
            for other, at in m.peer_classes.items():
                if other > priority and at > since:
                    return True
        self._expire(m, now)
        mine = self._decayed(m.served.get(tenant), now)
        served = self._decayed(m.served_total, now)
        total = m.weights
        if m.peers:
            mine += self._peer_served(m, tenant, now)
            served += self._decayed(m.peer_total, now)
            total += m.peer_only_weight
            if tenant not in m.tenants and not self._peer_active(m, tenant, now):
                total += weight
        elif tenant not in m.tenants:
            total += weight
        if mine <= 0.0:
            return False
        # A hair of tolerance: alone, a tenant's share is everything, whatever the float rounding.
        return mine * total > weight * served * (1.0 + 1e-9)

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
        if any(other < priority and at > since for other, at in m.peer_classes.items()):
            return True
        self._expire(m, now)
        active = len(m.tenants) + m.peer_only  # on any replica, each once
        return active > (1 if tenant in m.tenants or self._peer_active(m, tenant, now) else 0)

    def _model(self, model: str) -> _Model:
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = _Model()
        return m

    def _decayed(self, entry: tuple[float, float] | None, now: float) -> float:
        if entry is None:
            return 0.0
        value, at = entry
        return value * math.exp((at - now) / self.share_window) if now > at else value

    def _expire(self, m: _Model, now: float) -> None:
        heap = m.expiries
        while heap and heap[0][0] <= now:
            until, tenant = heapq.heappop(heap)
            held = m.tenants.get(tenant)
            if held is not None and held[0] == until:
                del m.tenants[tenant]
                m.weights -= held[1]
                p = m.peers.get(tenant) if m.peers else None
                if p is not None and p[0] > now:  # still active on a peer: its part here stays
                    m.held.add(tenant)
                    m.peer_only += 1
                    m.peer_only_weight += p[1]
                else:
                    self._leaves(m, tenant, now)
        if not m.tenants:
            m.weights = 0.0  # no float drift left behind
        heap = m.peer_heap
        if heap and heap[0][0] <= now:
            while heap and heap[0][0] <= now:
                until, tenant = heapq.heappop(heap)
                p = m.peers.get(tenant)
                if p is None or p[0] != until or tenant in m.tenants:
                    continue  # gone already, or still active here (it leaves with its window here)
                m.peer_only -= 1
                m.peer_only_weight -= p[1]
                self._leaves(m, tenant, now)
            if not m.peer_only:
                m.peer_only_weight = 0.0

    def _leaves(self, m: _Model, tenant: str, now: float) -> None:
        """`tenant` is active on no replica now: its served tokens leave the totals."""
        m.held.discard(tenant)
        gone = m.served.pop(tenant, None)  # remembered outside the total, for its return
        if gone is not None:  # ...and the others' standing is among themselves
            m.gone[tenant] = gone
            m.served_total = (max(0.0, self._decayed(m.served_total, now) - self._decayed(gone, now)), now)
        p = m.peers.pop(tenant, None) if m.peers else None
        if p is not None:
            m.peer_total = (max(0.0, self._decayed(m.peer_total, now) - self._decayed((p[2], p[3]), now)), now)

    def _peer_active(self, m: _Model, tenant: str, now: float) -> bool:
        p = m.peers.get(tenant) if m.peers else None
        return p is not None and p[0] > now

    def _peer_served(self, m: _Model, tenant: str, now: float) -> float:
        p = m.peers.get(tenant) if m.peers else None
        return 0.0 if p is None else self._decayed((p[2], p[3]), now)

    def share(self) -> tuple[ModelStanding, ...]:
        """This replica's own standing now, for its peers: only what it saw itself (never what
        it learned from them, which would echo), only what is active."""
        now = self._clock.monotonic()
        since = now - self.window
        out: list[ModelStanding] = []
        for name, m in self._models.items():
            self._expire(m, now)
            classes = tuple(ClassSeen(p, now - at) for p, at in m.classes.items() if at > since)
            tenants = [TenantStanding(t, w, until - now, self._decayed(m.served.get(t), now))
                       for t, (until, w) in m.tenants.items()]
            tenants += [TenantStanding(t, m.peers[t][1], 0.0, self._decayed(m.served.get(t), now)) for t in m.held]
            kept = self._local_kept(m)
            if classes or tenants or kept is not None:
                out.append(ModelStanding(name, classes, tuple(tenants), self._decayed(m.served_total, now), kept))
        return tuple(out)

    def apply_peers(self, peers: Sequence[Sequence[ModelStanding]]) -> None:
        """Replace the peers' standing with `peers` (every live peer's latest share; [] forgets
        them all). Relative times become this replica's clock now. O(the shares' size)."""
        now = self._clock.monotonic()
        since = now - self.window
        for m in self._models.values():
            self._expire(m, now)  # with what the peers said before
        fresh: dict[str, _Model] = {}
        for share in peers:
            for ms in share:
                f = fresh.get(ms.model)
                if f is None:
                    f = fresh[ms.model] = _Model()
                for c in ms.classes:
                    at = now - c.ago
                    if at > since and at > f.peer_classes.get(c.priority, -math.inf):
                        f.peer_classes[c.priority] = at
                for t in ms.tenants:
                    until = now + t.active_for if t.active_for > 0.0 else -math.inf
                    was = f.peers.get(t.tenant)
                    if was is None:
                        f.peers[t.tenant] = (until, t.weight, t.served, now)
                    else:
                        f.peers[t.tenant] = (max(until, was[0]), t.weight if until > was[0] else was[1],
                                             was[2] + t.served, now)
                f.peer_total = (f.peer_total[0] + ms.served_total, now)
                if ms.kept is not None:
                    f.peer_kept = ms.kept if f.peer_kept is None else max(f.peer_kept, ms.kept)
        for name in fresh.keys() - self._models.keys():
            self._models[name] = _Model()
        for name, m in self._models.items():
            f = fresh.get(name) or _Model()
            m.peer_classes, m.peers, m.peer_total, m.peer_kept = f.peer_classes, f.peers, f.peer_total, f.peer_kept
            m.peer_only, m.peer_only_weight = 0, 0.0
            for tenant, p in list(m.peers.items()):
                if p[0] <= now and tenant not in m.tenants:  # active on no replica: not in the totals
                    self._leaves(m, tenant, now)
            for tenant in list(m.held):
                if not self._peer_active(m, tenant, now):
                    self._leaves(m, tenant, now)
            m.peer_heap = [(p[0], tenant) for tenant, p in m.peers.items() if p[0] > now]
            heapq.heapify(m.peer_heap)
            for tenant, p in m.peers.items():
                if p[0] > now and tenant not in m.tenants:
                    m.peer_only += 1
                    m.peer_only_weight += p[1]
