"""Property: N replicas with random picks, releases, exchanges, deaths and partitions on an injected
clock. The model below tracks, independently of the code, what each replica published and when; the
properties:

- every replica's view of its peers is exactly the sum of their last shares that reached the store
  within the TTL of its own last exchange (nothing counted twice, nothing of a dead peer kept past it);
- the pool never holds more than the capacity plus what the picking replica could not have seen: its
  peers' tokens picked after their last share it read (the documented bound);
- nothing leaks: once every live replica released its requests and exchanged, and the dead ones'
  shares aged past the TTL, every view is empty.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from modeldock.clock import FakeClock
from modeldock.picking import Lease, Picker, Sample, Saturated, Saturation
from modeldock.sharing.config import SharingConfig
from modeldock.sharing.sync import Sharing
from modeldock.types import Endpoint
from tests.support.share_store import ShareHub

EP = Endpoint("10.0.0.1", 8000)
CAPACITY = 2000
CONFIG = SharingConfig(interval_ms=100, ttl_ms=1000, timeout_ms=100)
TTL = 1.0


@dataclass
class R:
    name: str
    picker: Picker
    sharing: Sharing
    leases: list[Lease] = field(default_factory=list)
    alive: bool = True
    # (store time, committed) of its last share that reached the store
    published: tuple[float, int] | None = None
    seen: dict[str, int] = field(default_factory=dict)  # what its last good exchange read of each peer

    def committed(self) -> int:
        return sum(lease.tokens for lease in self.leases if not lease.released)


OPS = st.lists(st.tuples(st.sampled_from(["pick", "release", "exchange", "advance", "kill", "cut", "heal"]),
                         st.integers(0, 2), st.integers(50, 900)), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(2, 3), ops=OPS)
def test_shared_views_are_exact_bounded_and_leak_nothing(n: int, ops: list[tuple[str, int, int]]) -> None:
    asyncio.run(_run(n, ops))


async def _run(n: int, ops: list[tuple[str, int, int]]) -> None:
    clock = FakeClock()
    hub = ShareHub(clock)
    rs = []
    for i in range(n):
        picker = Picker(clock, fallbacks=0, rng=random.Random(i), saturation=Saturation(room=True), stale_after=1e9)
        picker.set_endpoints("m", [EP])
        picker.observe(EP, Sample(waiting=0, running=0, kv=0.0, capacity=CAPACITY), clock.monotonic())
        rs.append(R(f"r{i}", picker, Sharing(picker, hub.store(), clock, CONFIG, CollectorRegistry(), replica=f"r{i}")))

    async def exchange(r: R) -> None:
        ok = await r.sharing.exchange()
        if not ok:
            return
        now = clock.monotonic()
        r.published = (now, r.committed())
        r.seen = {q.name: q.published[1] for q in rs
                  if q is not r and q.published is not None and now - q.published[0] <= TTL}
        view = r.picker.signals(EP).committed - r.committed()
        assert view == sum(r.seen.values())

    for op, who, amount in ops:
        r = rs[who % n]
        if op == "pick" and r.alive:
            unseen = sum(max(0, q.committed() - r.seen.get(q.name, 0)) for q in rs if q is not r and q.alive)
            try:
                r.leases.append(r.picker.pick("m", cost=amount).lease)
            except Saturated:
                continue
            total = sum(q.committed() for q in rs if q.alive)
            # Admitted on its view: over the capacity only by what it could not have seen (the first request
            # on an idle endpoint is always taken, whatever its size: none here is over the capacity).
            assert total <= CAPACITY + unseen
        elif op == "release" and r.alive and r.leases:
            r.leases.pop(amount % len(r.leases)).release()
        elif op == "exchange" and r.alive:
            await exchange(r)
        elif op == "advance":
            clock.advance(amount / 1000)
        elif op == "kill" and r.alive and sum(q.alive for q in rs) > 1:
            r.alive = False  # SIGKILL: no release, no leave; its requests end with it (Envoy resets them)
            r.leases.clear()
        elif op == "cut":
            hub.partitioned.add(r.name)
        elif op == "heal":
            hub.partitioned.discard(r.name)

    # The end: heal, every live replica releases everything, the dead ones' shares age out.
    hub.partitioned.clear()
    for r in rs:
        if r.alive:
            for lease in r.leases:
                lease.release()
            await exchange(r)
    clock.advance(TTL + 0.01)
    for r in rs:
        if r.alive:
            await exchange(r)
    for r in rs:
        if r.alive:
            s = r.picker.signals(EP)
            assert (s.in_flight, s.committed, r.picker.total_in_flight()) == (0, 0, 0)
            assert not r.picker.holdings()
