"""ext_proc CPU per request with load state shared through Redis, against one replica without sharing.

Target (the hot-path issue): ext_proc CPU per request at most +15% over one replica without sharing.

One set of simulators (1000x speed, room for every request at once) serves every path; each path is
whole stacks (xDS, ext_proc, Envoy, as `modeldock up` runs them, default config: no budgets, usage
records off) on that one pool:

- `alone`: one stack, no Redis, sharing off;
- `shared`: two stacks (`replica_stacks`, MODELDOCK_REPLICA r0 and r1) with `limits.redis_url` on one real
  Redis (`modeldock.devstack.redis_server`), so sharing is on: every pick and release brings an exchange
  forward (one Lua script: write this replica's share, read the peers', PUBLISH it to every peer's
  subscription), at most one per `min_gap_ms`;
- `split` (skip with `--no-split`): two stacks without Redis, sharing off. The client splits its requests
  round robin across the two Envoys of `shared` and of `split` alike, so each ext_proc sees half the
  concurrency; `shared ÷ split` is the cost of sharing alone, `split ÷ alone` the cost of the split (fewer
  streams per wake-up in each process, see the workers section).

The paths alternate round by round (reversed every other round) at each tier, with the same batch of
non-streaming one-token chat completions (the cheapest request, so the worst case for the relative cost
of sharing) at concurrency 16, then 4 (fewer picks per exchange coalesced by `min_gap_ms`). ext_proc CPU is
read from /proc, summed over the path's ext_proc processes. Idle stacks still scrape the simulators
(and a sharing replica exchanges every `interval_ms`), so before each batch the path is left idle for
`--idle` seconds and its CPU rate then is taken off the batch's CPU (rate x the batch's wall time): the
figure per request is net of idle scraping and of the periodic exchange, and the periodic cost is shown
apart (idle ms of CPU per second). Exchanges and pushes per request are the batch's deltas of the shared
replicas' `modeldock_sharing_exchanges_total{outcome="ok"}` and `modeldock_sharing_pushes_total` (gross:
the periodic exchanges during the batch included), summed over both replicas.

    .venv/bin/python -m benchmarks.sharing_cpu [--requests 1500] [--rounds 3] [--idle 3] [--no-split] [--no-write]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from benchmarks._load import load
from benchmarks._proc import cpu_seconds
from benchmarks._report import table, write_section
from benchmarks.workers import SIM_ARGS
from modeldock.devstack.redis_server import RedisServer
from modeldock.devstack.stack import Sim, Stack, replica_stacks, running_stack, wait_until

TIERS = (16, 4)
TARGET = 1.15
EXCHANGES = ("modeldock_sharing_exchanges_total", 'outcome="ok"')
PUSHES = ("modeldock_sharing_pushes_total", "")


@dataclass
class Route:
    """One path: its front doors (round robin), its ext_proc processes and their metrics ports."""

    name: str
    stacks: list[Stack]
    sharing: bool

    @property
    def urls(self) -> list[str]:
        return [s.base_url for s in self.stacks]

    @property
    def extproc_pids(self) -> list[int]:
        return [c.proc.pid for s in self.stacks for c in s.sup.children if c.name.startswith("extproc")]

    def cpu(self) -> float:
        return sum(cpu_seconds(p) for p in self.extproc_pids)

    def counter(self, metric: tuple[str, str]) -> float:
        return sum(_sample(s.extproc_metrics_port, *metric) for s in self.stacks) if self.sharing else 0.0


@dataclass
class Batch:
    """One path's batch at one tier in one round."""

    sent: int
    errors: int
    wall: float
    cpu: float  # ext_proc CPU seconds over the batch, gross
    idle_rate: float  # ext_proc CPU seconds per second just before, idle
    exchanges: float = 0.0
    pushes: float = 0.0
    redis_cpu: float = 0.0
    redis_idle_rate: float = 0.0
    redis_commands: float = 0.0  # every command Redis ran, those inside scripts too
    redis_scripts: float = 0.0  # EVALSHA / EVAL

    @property
    def net(self) -> float:
        return self.cpu - self.idle_rate * self.wall

    @property
    def redis_net(self) -> float:
        return self.redis_cpu - self.redis_idle_rate * self.wall


@dataclass
class Results:
    batches: dict[tuple[str, int], list[Batch]] = field(default_factory=dict)

    def of(self, path: str, tier: int) -> list[Batch]:
        return self.batches.get((path, tier), [])

    def paths(self) -> list[str]:
        return list(dict.fromkeys(p for p, _ in self.batches))


def _sample(port: int, name: str, label: str) -> float:
    """Sum of a metric's samples on one ext_proc's /metrics, those with `label` (e.g. `outcome="ok"`) only."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()  # noqa: S310
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {" and label in line.rsplit(" ", 1)[0]:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _redis_calls(client: redis.Redis) -> tuple[float, float]:
    """(commands, scripts) Redis has run since it started, from INFO commandstats (INFO itself left out)."""
    stats: dict[str, dict[str, Any]] = client.info("commandstats")
    commands = sum(float(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")
    return commands, sum(float(stats.get(k, {}).get("calls", 0)) for k in ("cmdstat_evalsha", "cmdstat_eval"))


def _sharing_off(data: dict[str, Any], _sims: list[Sim]) -> None:
    data["sharing"] = {"enabled": False}  # off even should the environment bring a $REDIS_URL


@contextmanager
def _routes(tmp: Path, redis_url: str, split: bool) -> Iterator[list[Route]]:
    """The paths' stacks on one pool of simulators (the shared pair owns it); all stopped on exit."""
    with ExitStack() as owned:
        reps = owned.enter_context(replica_stacks(tmp / "shared", replicas=2, backends=2, sim_args=SIM_ARGS,
                                                  redis_url=redis_url, log_level="info"))

        def plain(name: str) -> Stack:
            return owned.enter_context(running_stack(tmp / name, sims=reps.sims, edit_config=_sharing_off,
                                                     log_level="info", extproc_env={"MODELDOCK_REPLICA": name}))
        routes = [Route("alone", [plain("alone")], False), Route("shared", reps.stacks, True)]
        if split:
            routes.append(Route("split", [plain("s0"), plain("s1")], False))
        def peers_seen() -> bool:  # sharing on: each replica counts its peer
            return all(_sample(s.extproc_metrics_port, "modeldock_sharing_peers", "") >= 1 for s in reps.stacks)
        wait_until(peers_seen, 30, what="the shared replicas seeing each other")
        yield routes


async def _measure(route: Route, tier: int, args: argparse.Namespace, redis_pid: int,
                   client: redis.Redis) -> Batch:
    await asyncio.sleep(args.settle)
    idle0, ridle0, t0 = route.cpu(), cpu_seconds(redis_pid), time.monotonic()
    await asyncio.sleep(args.idle)
    idle_wall = time.monotonic() - t0
    idle_rate, redis_idle = (route.cpu() - idle0) / idle_wall, (cpu_seconds(redis_pid) - ridle0) / idle_wall
    ex0, push0 = route.counter(EXCHANGES), route.counter(PUSHES)
    cmd0, scripts0 = _redis_calls(client)
    cpu0, rcpu0, t0 = route.cpu(), cpu_seconds(redis_pid), time.monotonic()
    done, errors = await load(route.urls, args.requests, tier)
    wall = time.monotonic() - t0
    cpu, rcpu = route.cpu() - cpu0, cpu_seconds(redis_pid) - rcpu0
    cmds, scripts = _redis_calls(client)
    return Batch(done + errors, errors, wall, cpu, idle_rate, route.counter(EXCHANGES) - ex0,
                 route.counter(PUSHES) - push0, rcpu, redis_idle, cmds - cmd0, scripts - scripts0)


async def run(args: argparse.Namespace) -> Results:
    results = Results()
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as server, \
            _routes(Path(tmp), server.url, args.split) as routes:
        pid = server.pid
        assert pid is not None
        client = redis.Redis.from_url(server.url)
        try:
            for route in routes:  # warm-up: connections, lazily built state
                await load(route.urls, 300, TIERS[0])
            for round_ in range(args.rounds):
                order = routes if round_ % 2 == 0 else routes[::-1]
                for tier in TIERS:
                    for route in order:
                        batch = await _measure(route, tier, args, pid, client)
                        results.batches.setdefault((route.name, tier), []).append(batch)
                        print(f"round {round_ + 1} c={tier} {route.name}: {batch.net / batch.sent * 1e6:.0f} "
                              f"µs/request net, {batch.sent / batch.wall:.0f}/s, {batch.errors} errors", flush=True)
        finally:
            client.close()
    return results


def _per_request_us(batches: Sequence[Batch]) -> float:
    return sum(b.net for b in batches) / sum(b.sent for b in batches) * 1e6


def _ratios(num: Sequence[Batch], den: Sequence[Batch]) -> list[float]:
    return [(a.net / a.sent) / (b.net / b.sent) for a, b in zip(num, den, strict=True)]


def _ratio_cell(results: Results, num: str, den: str, tier: int) -> tuple[float, str]:
    a, b = results.of(num, tier), results.of(den, tier)
    ratio = _per_request_us(a) / _per_request_us(b)
    per = _ratios(a, b)
    return ratio, f"**{ratio:.2f}x** ({min(per):.2f}-{max(per):.2f})"


def report(results: Results) -> str:
    rows: list[list[object]] = []
    for tier in TIERS:
        for path in results.paths():
            bs = results.of(path, tier)
            sent = sum(b.sent for b in bs)
            wall = sum(b.wall for b in bs)
            shared = path == "shared"
            rows.append([
                f"c={tier}", path, f"{_per_request_us(bs):.0f}",
                " / ".join(f"{b.net / b.sent * 1e6:.0f}" for b in bs),
                f"{sum(b.idle_rate for b in bs) / len(bs) * 1000:.1f}",
                f"{(sent - sum(b.errors for b in bs)) / wall:.0f}", sum(b.errors for b in bs),
                f"{sum(b.exchanges for b in bs) / sent:.2f}" if shared else "-",
                f"{sum(b.pushes for b in bs) / sent:.2f}" if shared else "-",
                f"{sum(b.redis_scripts for b in bs) / sent:.2f} / {sum(b.redis_commands for b in bs) / sent:.2f}"
                if shared else "-",
                f"{sum(b.redis_net for b in bs) / sent * 1e6:.0f}" if shared else "-",
            ])
    text = table(["tier", "path", "ext_proc CPU µs/request (net)", "per round",
                  "idle ext_proc CPU (ms/s, all its processes)", "requests/s", "errors", "exchanges/request",
                  "pushes/request", "Redis scripts / commands per request", "Redis CPU µs/request (net)"], rows)
    ratio_rows: list[list[object]] = []
    worst = 0.0
    for tier in TIERS:
        ratio, cell = _ratio_cell(results, "shared", "alone", tier)
        worst = max(worst, ratio)
        row: list[object] = [f"c={tier}", cell]
        if "split" in results.paths():
            row += [_ratio_cell(results, "shared", "split", tier)[1], _ratio_cell(results, "split", "alone", tier)[1]]
        ratio_rows.append(row)
    headers = ["tier", "shared ÷ alone (min-max over rounds)"]
    if "split" in results.paths():
        headers += ["shared ÷ split (sharing alone)", "split ÷ alone (the split alone)"]
    text += "\n\next_proc CPU per request, net, as ratios:\n\n" + table(headers, ratio_rows)
    errors = sum(b.errors for bs in results.batches.values() for b in bs)
    if "split" in results.paths():
        # Sharing's own cost is against the same two replicas without it: splitting the load over two
        # processes costs what it costs with sharing or without (fewer requests per wake-up each).
        own = max(_ratio_cell(results, "shared", "split", tier)[0] for tier in TIERS)
        verdict = "met" if own <= TARGET else "NOT met"
        text += (f"\n\nTarget, sharing's own cost (shared ÷ split, the same two replicas without it) <= "
                 f"{TARGET:.2f}x at every tier: **{verdict}** (worst {own:.2f}x). Against one replica alone "
                 f"(shared ÷ alone) the worst is {worst:.2f}x, of which the split alone accounts for the "
                 f"split ÷ alone column. Errors: {errors}.")
    else:
        verdict = "met" if worst <= TARGET else "NOT met"
        text += (f"\n\nTarget shared ÷ alone <= {TARGET:.2f}x at every tier: **{verdict}** (worst {worst:.2f}x). "
                 f"Errors: {errors}.")
    parts = []
    for tier in TIERS:
        bs = results.of("shared", tier)
        sent = sum(b.sent for b in bs)
        exchanges, pushes = sum(b.exchanges for b in bs) / sent, sum(b.pushes for b in bs) / sent
        base = "split" if "split" in results.paths() else "alone"
        extra = _per_request_us(bs) - _per_request_us(results.of(base, tier))
        parts.append(f"at c={tier}, {exchanges:.2f} exchanges and {pushes:.2f} pushes per request, "
                     f"{extra:+.0f} µs of ext_proc CPU per request over `{base}`")
    text += (" Exchanges brought forward by the requests (beyond the interval's), and the CPU over the path "
             "without sharing: " + "; ".join(parts) + " (a pick is pushed at once only on an endpoint at least "
             "`sharing.push_above` full, and these backends have room for every request).")
    idle = {p: [b.idle_rate for t in TIERS for b in results.of(p, t)] for p in results.paths()}
    text += (" Idle, between batches (the periodic exchange, 10/s per replica, and scraping): "
             + ", ".join(f"`{p}` {sum(v) / len(v) * 1000:.1f} ms of ext_proc CPU per second" for p, v in idle.items())
             + ".")
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1500, help="requests per path per tier per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=float, default=3.0, help="idle seconds measured before each batch")
    parser.add_argument("--settle", type=float, default=1.0, help="idle seconds before the idle measurement")
    parser.add_argument("--no-split", dest="split", action="store_false",
                        help="leave out the `split` path (two stacks, no Redis)")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    os.environ.pop("REDIS_URL", None)  # the stacks' Redis is the configs' own
    text = report(asyncio.run(run(args)))
    print(text)
    if not args.no_write:
        paths = "`alone`, `shared` and `split`" if args.split else "`alone` and `shared`"
        intro = (f"{args.requests} non-streaming one-token chat completions per path per tier per round at "
                 f"concurrency {' then '.join(str(t) for t in TIERS)}, over {args.rounds} rounds alternating "
                 f"{paths} (reversed every other round), against two simulators at 1000x speed shared by every "
                 "path. `alone` is one stack (xDS, ext_proc, Envoy; default config: no budgets, usage records "
                 "off) without Redis; `shared` two stacks whose configs set `limits.redis_url` to one real Redis, "
                 "so they share load state (an exchange brought forward by every pick and release, at most one "
                 "per `min_gap_ms`, its share pushed to the peer)")
        if args.split:
            intro += "; `split` two stacks without Redis"
        intro += (". The client sends its requests round robin to the two Envoys of a two-stack path, and ext_proc "
                  "CPU is summed over its processes. Net = the batch's ext_proc CPU less the path's idle rate "
                  f"(measured for {args.idle:g} s just before the batch: scraping, and the periodic exchange) times "
                  "the batch's wall time. Exchanges and pushes per request: the batch's deltas of "
                  "`modeldock_sharing_exchanges_total{outcome=\"ok\"}` and `modeldock_sharing_pushes_total`, "
                  "both replicas. Redis scripts / commands per request from `INFO commandstats`, which counts "
                  "the commands inside a script too: an exchange is one EVALSHA running TIME, HSET, PEXPIRE, "
                  "PUBLISH and HGETALL (and HDEL for a stale share), so commands = 6 x scripts means nothing else "
                  "of a request reached Redis.")
        write_section("sharing-cpu", "Sharing load state: ext_proc CPU per request, shared against alone",
                      "python -m benchmarks.sharing_cpu", intro + "\n\n" + text)


if __name__ == "__main__":
    main()
