"""What sharing load state costs one replica, side by side in one run:

1. pick + release on the hot path with no peers and with peers holding requests on every endpoint
   (the same code; the peers only change the numbers `Load.signals` adds), at 8 and 64 endpoints;
2. one exchange's CPU (build the share, encode, decode every peer's, merge, apply) against a memory
   store, with 2 and 8 peers, as a share of one core at the default 10 exchanges a second;
3. with `--before PATH` (a checkout before sharing, e.g. `git worktree add /tmp/base 4935fca`), pick +
   release there and here, alternated in subprocesses.

    .venv/bin/python -m benchmarks.sharing_cost [--before /tmp/base] [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time

from benchmarks._report import table, write_section
from modeldock.clock import SystemClock
from modeldock.picking import Lease, Picker, Sample
from modeldock.picking.peers import Holding, PeerLoad
from modeldock.sharing.config import SharingConfig
from modeldock.sharing.records import ReplicaShare, encode
from modeldock.sharing.sync import Sharing
from modeldock.types import Endpoint

COMMAND = ".venv/bin/python -m benchmarks.sharing_cost --before /tmp/base28 --write"
PICK_SNIPPET = ("from benchmarks.picking import time_pick; "
                "print(min(time_pick(8, rounds=20000) for _ in range(5)), "
                "min(time_pick(64, rounds=10000) for _ in range(5)))")


def _picker(n: int) -> tuple[Picker, list[Endpoint]]:
    clock = SystemClock()
    picker = Picker(clock, rng=random.Random(1))
    eps = [Endpoint(f"10.0.0.{i + 1}", 8000) for i in range(n)]
    picker.set_endpoints("m", eps)
    for i, ep in enumerate(eps):
        picker.observe(ep, Sample(waiting=i % 3, running=10 + i, kv=0.1 * (i % 5)), clock.monotonic())
    return picker, eps


def _peer_share(eps: list[Endpoint], per_endpoint: int = 4) -> list[Holding]:
    return [Holding(ep.address, per_endpoint, 300 * per_endpoint,
                    tuple((0.1 * k, 300, 100) for k in range(per_endpoint)),
                    tuple((50.0 + k, 300) for k in range(per_endpoint))) for ep in eps]


def time_pick(n: int, peers: int, rounds: int) -> float:
    """µs per pick + release over `n` endpoints, `peers` peers holding 4 requests on each."""
    picker, eps = _picker(n)
    if peers:
        now = time.monotonic()
        picker.set_peers(PeerLoad.merge([(0.05, _peer_share(eps)) for _ in range(peers)], now))
    leases: list[Lease] = []
    start = time.perf_counter()
    for _ in range(rounds):
        leases.append(picker.pick("m", cost=300, output=100).lease)
        if len(leases) > 64:
            leases.pop(0).release()
    return (time.perf_counter() - start) / rounds * 1e6


class _Store:
    def __init__(self, shares: list[bytes]) -> None:
        self.shares = shares

    async def exchange(self, replica: str, share: bytes, ttl_ms: int) -> list[tuple[str, float, bytes]]:
        return [(f"p{i}", 0.05, s) for i, s in enumerate(self.shares)]

    async def leave(self, replica: str) -> None: ...

    async def close(self) -> None: ...


def time_exchange(n: int, peers: int, rounds: int = 500) -> float:
    """µs of CPU per exchange (the store answers at once: the Redis round trip is I/O, not counted)."""
    picker, eps = _picker(n)
    for _ in range(min(64, 4 * n)):
        picker.pick("m", cost=300, output=100)
    shares = [encode(ReplicaShare(holdings=tuple(_peer_share(eps)))) for _ in range(peers)]
    sharing = Sharing(picker, _Store(shares), SystemClock(), SharingConfig(), None, replica="me")

    async def run() -> float:
        await sharing.exchange()
        start = time.process_time()
        for _ in range(rounds):
            await sharing.exchange()
        return (time.process_time() - start) / rounds * 1e6

    return asyncio.run(run())


def before_after(before: str, times: int = 3) -> list[tuple[str, float, float]]:
    runs: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    here = os.getcwd()
    for _ in range(times):
        for label, path in (("before", before), ("after", here)):
            out = subprocess.run([sys.executable, "-c", PICK_SNIPPET], cwd=path, env={**os.environ, "PYTHONPATH": path},
                                 capture_output=True, text=True, check=True).stdout.split()
            runs[label].append((float(out[0]), float(out[1])))
    return [(f"n={n}", min(r[i] for r in runs["before"]), min(r[i] for r in runs["after"]))
            for i, n in enumerate((8, 64))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default=None, help="a checkout before sharing, for pick + release before/after")
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    rows: list[list[object]] = []
    for n in (8, 64):
        alone = min(time_pick(n, 0, 10000) for _ in range(5))
        shared = min(time_pick(n, 2, 10000) for _ in range(5))
        rows.append([f"{n}", f"{alone:.1f}", f"{shared:.1f}", f"{shared / alone:.2f}x"])
    picks = table(["endpoints", "no peers (µs)", "2 peers, 4 requests each per endpoint (µs)", "ratio"], rows)
    ex_rows: list[list[object]] = []
    for n in (8, 64):
        for peers in (2, 8):
            us = min(time_exchange(n, peers) for _ in range(3))
            ex_rows.append([f"{n}", f"{peers}", f"{us:.0f}", f"{us * 10 / 1e6:.2%}"])
    exchanges = table(["endpoints", "peers", "CPU per exchange (µs)", "share of one core at 10/s"], ex_rows)
    body = ("Pick + release (`default` policy, fresh samples, 64 in flight), the same code with and without "
            "peers' holdings, best of 5:\n\n" + picks + "\n\nOne exchange's CPU, the Redis round trip excluded "
            "(a memory store answers at once), best of 3 x 500:\n\n" + exchanges + "\n")
    if args.before:
        ba = before_after(args.before)
        body += ("\nPick + release before sharing (`--before`, 4935fca) and after, `benchmarks.picking.time_pick`, "
                 "alternated 3 times in subprocesses, best of each:\n\n"
                 + table(["", "before (µs)", "after (µs)", "after / before"],
                         [[label, f"{b:.1f}", f"{a:.1f}", f"{a / b:.2f}x"] for label, b, a in ba]) + "\n")
    body += ("\nReading: a pick costs the same with peers as without (the "
             "peers' sums are added in `Load.signals`, nothing per peer). Against the code before sharing a claim "
             "adds a clock read and a dict entry: two runs gave 1.02x and 1.29x at 8 endpoints, 1.01x and 1.05x at "
             "64, so this shared machine's noise is larger than the cost. The exchange grows with endpoints x "
             "peers' requests (each peer request's end is placed in the endpoint's sorted `ends`): a few tenths "
             "of a percent of a core for a few replicas, several percent at 64 endpoints with 8 peers. That is "
             "work for the scale issue (apply only what changed).\n")
    print(body)
    if args.write:
        write_section("sharing-cost", "Sharing load state: the cost on one replica", COMMAND, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
