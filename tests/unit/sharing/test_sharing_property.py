"""Property: N replicas with random picks, releases, exchanges, pushes delivered, deaths and partitions
on an injected clock. The model below tracks, independently of the code, what each replica published and
when, and which pushes reached whom; the properties:

- every replica's view of its peers is exactly the sum of the newest share of each that it took in, from
  its last exchange's reply (every share in the store within the TTL) or from a push delivered since
  (nothing counted twice, an older share never over a newer one, nothing of a dead peer kept past the
  TTL);
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
    inbox: list[tuple[str, int, int]] = field(default_factory=list)  # undelivered pushes: (peer, index, committed)
    # (store time, committed, publication index) of its last share that reached the store
    published: tuple[float, int, int] | None = None
    latest: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # peer -> (index, committed, taken at)
    queue: asyncio.Queue[tuple[str, bytes]] | None = None  # the hub's pushes to it

    @property
    def seen(self) -> dict[str, int]:
        """What its view counts of each peer (nothing on the local view)."""
        return {name: c for name, (_, c, _) in self.latest.items()} if self.sharing.shared else {}

    def committed(self) -> int:
        return sum(lease.tokens for lease in self.leases if not lease.released)


OPS = st.lists(st.tuples(st.sampled_from(["pick", "release", "exchange", "push", "advance", "kill", "cut", "heal"]),
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
        store = hub.store()
        queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        hub.listeners[store] = queue  # subscribed from the start; pushes are delivered one by one below
        store.replica = f"r{i}"
        rs.append(R(f"r{i}", picker, Sharing(picker, store, clock, CONFIG, CollectorRegistry(), replica=f"r{i}"),
                    queue=queue))
    index = 0

    def check_view(r: R) -> None:
        view = r.picker.signals(EP).committed - r.committed()
        assert view == sum(r.seen.values())

    async def exchange(r: R) -> None:
        nonlocal index
        was_shared = r.sharing.shared
        ok = await r.sharing.exchange()
        now = clock.monotonic()
        if not ok:
            if was_shared and not r.sharing.shared:
                r.latest.clear()  # the local view: what it held of its peers is gone
            return
        index += 1
        r.published = (now, r.committed(), index)
        for q in rs:  # the script published it to every live peer's channel (a share within the TTL), not cut off
            if (q is not r and q.name not in hub.partitioned and q.published is not None
                    and now - q.published[0] <= TTL):
                q.inbox.append((r.name, index, r.published[1]))
        reply = {q.name: q.published for q in rs
                 if q is not r and q.published is not None and now - q.published[0] <= TTL}
        for name, (_, committed, idx) in reply.items():
            if name not in r.latest or idx > r.latest[name][0]:
                r.latest[name] = (idx, committed, now)
        r.latest = {name: v for name, v in r.latest.items() if name in reply or v[2] >= now}
        check_view(r)

    def push(r: R) -> None:
        assert r.queue is not None and r.queue.qsize() == len(r.inbox)
        if not r.inbox:
            return
        name, payload = r.queue.get_nowait()
        peer, idx, committed = r.inbox.pop(0)
        assert name == peer
        r.sharing.pushed(name, payload)
        if peer not in r.latest or idx > r.latest[peer][0]:
            r.latest[peer] = (idx, committed, clock.monotonic())
        check_view(r)

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
        elif op == "push" and r.alive:
            push(r)
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
