"""The ceiling of a queue that never preempts: the overload benchmark's schedules replayed offline.

The simulator's own engine (modeldock.sim.engine, what every simulated backend runs) steps in
simulated time, driven by a gateway that knows every sequence's exact progress: no pages, no
staleness, no network. What the queue serves here is the most its policy can serve on that
schedule without a preemption. One more row puts the gateway's own picker (modeldock.picking)
in that place, knowing the engines only from their pages as the scraper reads them: the distance
between the two is what the gateway does not know; from that row to the real benchmark (run.py)
is Envoy, HTTP and a shared CPU. It answers questions of policy and of estimation (how long to let
smaller requests pass a head that does not fit, what the paged margin costs, what an ending frees)
in seconds per seed, deterministically, instead of minutes of noisy phases.

    .venv/bin/python -m benchmarks.overload.ceiling                    # seeds 1-5, writes the `ceiling` section
    .venv/bin/python -m benchmarks.overload.ceiling --seeds 2 --no-write

Modelled as in run.py's defaults: 3 backends (the last at half speed), max_num_seqs 4, 112 blocks
of 16 tokens, the mix, 1.15x the capacity for 30 s. The capacity is the same closed loop as
run.py's (backends x max_num_seqs clients, 30 s counted after 4 s), replayed with no queue. The
queue: one tenant, FIFO; backfill as flowcontrol/queue.py (the first 16 behind the head, at most
4 tried, each smaller than every one refused) while the head has waited less than
`backfill_seconds`; the drain budget as the director's (once the oldest queued has waited half of
`max_wait_seconds`, refuse when the tokens queued exceed the closed loop's tokens/s times it). A
request fits an endpoint when, stepping its sequences to their ends, the new one's prompt and
growth never exceed the cache: with the gateway's paged margin (`block_size - 1` tokens for each
sequence and the new one, as picking/saturation.py) or in exact blocks. Not modelled: the TTL
(10 s, never reached here), tenants and classes, prefix caching (the prompts share no prefix).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from benchmarks._report import table, write_section
from benchmarks.overload import plan
from benchmarks.routing.workloads import Request
from modeldock.bench.stats import nearest_rank
from modeldock.clock import FakeClock
from modeldock.config import RoutingConfig
from modeldock.flowcontrol import QueueConfig
from modeldock.flowcontrol.cost import estimate_cost
from modeldock.flowcontrol.queue import BACKFILL_SCAN, BACKFILL_TRIES, SHED_AFTER
from modeldock.picking import Lease, Sample, Saturated
from modeldock.picking.factory import build_picker
from modeldock.sim.config import SimConfig
from modeldock.sim.engine import Engine, StepResult
from modeldock.types import Endpoint


@dataclass(frozen=True)
class Pool:
    backends: int = 3
    slow_factor: float = 0.5  # the last backend's speed
    max_num_seqs: int = 4
    num_gpu_blocks: int = 112
    block_size: int = 16

    def engines(self) -> list[Engine]:
        config = SimConfig(max_num_seqs=self.max_num_seqs, num_gpu_blocks=self.num_gpu_blocks,
                           block_size=self.block_size, max_model_len=self.num_gpu_blocks * self.block_size)
        return [Engine(config) for _ in range(self.backends)]

    def speeds(self) -> list[float]:
        return [1.0] * (self.backends - 1) + [self.slow_factor]


@dataclass(frozen=True)
class Policy:
    name: str
    queue: bool = True
    backfill_seconds: float = 1.0
    max_wait_seconds: float | None = 0.5
    paged_margin: bool = True  # False: count the cache in exact blocks
    picker: bool = False  # the gateway's picker on pages decides what fits (PickerReplay)


@dataclass(frozen=True)
class Outcome:
    offered: int
    served: int
    ttft_p95: float | None
    preemptions: int

    @property
    def served_pct(self) -> float:
        return 100.0 * self.served / self.offered if self.offered else 0.0


def fits(engine: Engine, prompt: int, output: int, pool: Pool, paged_margin: bool) -> bool:
    """Whether a request fits beside the engine's sequences until it ends, never preempting."""
    seqs = [(s.num_tokens, s.max_tokens - s.num_output) for s in itertools.chain(engine.running, engine.waiting)]
    if len(seqs) >= pool.max_num_seqs:
        return False
    block, capacity = pool.block_size, pool.num_gpu_blocks * pool.block_size
    # At step j (1 = the next) a sequence of t tokens with r steps left holds t + j - 1 while j <= r;
    # the total only grows between two endings, so its peaks are at the last step before each.
    for j in {output} | {r for _, r in seqs if r < output}:
        live = [t + j - 1 for t, r in seqs if r >= j]
        if paged_margin:
            need = prompt + j - 1 + sum(live) + (block - 1) * (len(seqs) + 1)
        else:
            need = block * (-(-(prompt + j - 1) // block) + sum(-(-x // block) for x in live))
        if need > capacity:
            return False
    return True


class Replay:
    """One run: the engines in simulated time and the gateway's decisions at each event."""

    def __init__(self, pool: Pool, policy: Policy, drain_tokens_per_s: float = 0.0) -> None:
        self.pool, self.policy, self.drain = pool, policy, drain_tokens_per_s
        self.engines, self.speeds = pool.engines(), pool.speeds()
        self.busy = [False] * pool.backends
        self.events: list[tuple[float, int, Request | tuple[int, StepResult]]] = []
        self.order = itertools.count()
        self.queue: list[tuple[float, Request]] = []
        self.sent: dict[str, Request] = {}
        self.arrived: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        self.on_end: Callable[[Request, float], None] | None = None

    def _push(self, at: float, payload: Request | tuple[int, StepResult]) -> None:
        heapq.heappush(self.events, (at, next(self.order), payload))

    def _step(self, e: int, now: float) -> None:
        if not self.busy[e] and self.engines[e].has_work():
            result = self.engines[e].step()
            self.busy[e] = True
            self._push(now + result.duration_s / self.speeds[e], (e, result))

    def _send(self, e: int, r: Request, now: float) -> None:
        rid = str(r.index)
        self.sent[rid] = r
        self.engines[e].add(rid, r.prompt_tokens, r.max_tokens)
        self._step(e, now)

    def _place(self, r: Request, now: float) -> bool:
        engines = self.engines
        if not self.policy.queue:  # fewest requests per unit of speed, as a least-loaded picker
            self._send(min(range(len(engines)), key=lambda i: (engines[i].num_running + engines[i].num_waiting)
                           / self.speeds[i]), r, now)
            return True
        room = [i for i, eng in enumerate(engines)
                if fits(eng, r.prompt_tokens, r.max_tokens, self.pool, self.policy.paged_margin)]
        if not room:
            return False
        self._send(min(room, key=lambda i: (engines[i].num_running + engines[i].num_waiting, -self.speeds[i])), r, now)
        return True

    def _dispatch(self, now: float) -> None:
        queue = self.queue
        while queue:
            head_at, head = queue[0]
            if self._place(head, now):
                queue.pop(0)
                continue
            if now - head_at >= self.policy.backfill_seconds:
                return
            smallest, tries = head.prompt_tokens + head.max_tokens, 0
            for k in range(1, min(len(queue), BACKFILL_SCAN + 1)):
                r = queue[k][1]
                if r.prompt_tokens + r.max_tokens >= smallest:
                    continue
                if self._place(r, now):
                    queue.pop(k)
                    break
                smallest, tries = r.prompt_tokens + r.max_tokens, tries + 1
                if tries >= BACKFILL_TRIES:
                    return
            else:
                return

    def _arrive(self, r: Request, now: float) -> None:
        self.arrived[str(r.index)] = now
        if not self.policy.queue:
            self._place(r, now)
            return
        if not self.queue and self._place(r, now):
            return
        wait = self.policy.max_wait_seconds
        ahead = sum(q.prompt_tokens + q.max_tokens for _, q in self.queue)
        if (wait is not None and self.queue and now - self.queue[0][0] >= wait * SHED_AFTER
                and ahead > self.drain * wait):
            return  # 429 queue_full
        self.queue.append((now, r))
        self._dispatch(now)

    def run(self, arrivals: Sequence[tuple[float, Request]], until: float = float("inf")) -> None:
        for at, r in arrivals:
            self._push(at, r)
        while self.events and self.events[0][0] < until:
            self._until(self.events[0][0])
            now, _, payload = heapq.heappop(self.events)
            if isinstance(payload, Request):
                self._arrive(payload, now)
                continue
            e, result = payload
            self.busy[e] = False
            for out in result.outputs:
                self.first.setdefault(out.request_id, now)
            self._done(e, result, now)
            self._step(e, now)

    def _until(self, at: float) -> None:
        """Before the next event, at `at`: nothing here (the gateway knows every step as it ends)."""

    def _done(self, e: int, result: StepResult, now: float) -> None:
        for rid in result.finished:
            self.ended[rid] = now
            if self.on_end is not None:
                self.on_end(self.sent[rid], now)
        if self.policy.queue:
            self._dispatch(now)  # exact knowledge: the room of every step is seen at once

    def outcome(self, requests: Sequence[Request]) -> Outcome:
        ttfts = sorted(self.first[str(r.index)] - self.arrived[str(r.index)] for r in requests
                       if str(r.index) in self.ended)
        return Outcome(len(requests), len(ttfts), nearest_rank(ttfts, 95) if ttfts else None,
                       sum(e.preemptions for e in self.engines))

class PickerReplay(Replay):
    """The gateway's own picker decides where a request fits (modeldock.picking with the default
    routing config: the tokens rule, the batch limit, the step count), knowing the engines only
    from their pages, read every `routing.scrape.interval_seconds` and after each ending (none
    within `refresh_gap_seconds` of the last read), as the scraper does; the queue tries its
    requests at each ending and each page. Nothing crosses a network: the real benchmark's
    distance from this row is Envoy, HTTP and a shared CPU."""

    def __init__(self, pool: Pool, policy: Policy, drain_tokens_per_s: float = 0.0) -> None:
        super().__init__(pool, policy, drain_tokens_per_s)
        routing = RoutingConfig()
        self.clock = FakeClock(start=0.0)
        self.picker = build_picker(routing, self.clock, None, rng=random.Random(0))
        self.endpoints = [Endpoint("127.0.0.1", 8000 + i) for i in range(pool.backends)]
        self.picker.set_endpoints(plan.MODEL, self.endpoints, None, pool.max_num_seqs)
        self.interval, self.gap = routing.scrape.interval_seconds, routing.scrape.refresh_gap_seconds
        self.next_read = [0.0] * pool.backends
        self.last_read = [float("-inf")] * pool.backends
        self.prompt_tokens = [0] * pool.backends  # vllm:prompt_tokens_total and generation_tokens_total
        self.generated = [0] * pool.backends
        self.leases: dict[str, Lease] = {}
        self.default_max_tokens = QueueConfig().default_max_tokens

    def _read(self, e: int, at: float, out_of_turn: bool = False) -> None:
        engine, pool = self.engines[e], self.pool
        self._at(at)
        page = Sample(engine.num_waiting, engine.num_running, engine.kv_usage,
                      float(pool.num_gpu_blocks * pool.block_size),
                      tokens_total=float(self.prompt_tokens[e] + self.generated[e]),
                      generated_total=float(self.generated[e]), block_size=pool.block_size)
        self.picker.observe(self.endpoints[e], page, at, out_of_turn=out_of_turn)
        self.last_read[e] = at

    def _at(self, at: float) -> None:
        self.clock.advance(at - self.clock.monotonic())

    def _until(self, at: float) -> None:
        """The rounds' pages due by `at`, in time order."""
        while (due := min(self.next_read)) <= at:
            e = self.next_read.index(due)
            self._read(e, due)
            self.next_read[e] += self.interval
            if self.queue:  # a fresh sample: room may have appeared
                self._dispatch(due)

    def _place(self, r: Request, now: float) -> bool:
        self._at(now)
        cost = estimate_cost({"messages": list(r.messages), "max_tokens": r.max_tokens}, self.default_max_tokens)
        try:
            pick = self.picker.pick(plan.MODEL, cost=cost.total, output=cost.max_new_tokens)
        except Saturated:
            return False
        self.leases[str(r.index)] = pick.lease
        self._send(self.endpoints.index(pick.primary), r, now)
        return True

    def _done(self, e: int, result: StepResult, now: float) -> None:
        self.prompt_tokens[e] += result.prompt_tokens
        self.generated[e] += len(result.outputs)
        for rid in result.finished:
            self.ended[rid] = now
            self.leases.pop(rid).release()
        if result.finished:
            if self.gap and now - self.last_read[e] >= self.gap:
                self._read(e, now, out_of_turn=True)
            self._dispatch(now)


def capacity(pool: Pool, seed: int, mix: plan.Mix, warmup: float = 4.0, duration: float = 34.0) -> tuple[float, float]:
    """run.py's closed loop, replayed with no queue: (requests/s, tokens/s) completed in [warmup, duration)."""
    concurrency = pool.backends * pool.max_num_seqs
    requests = iter(plan.closed_loop_requests(seed, int(duration * 80) + 200, mix))
    replay = Replay(pool, Policy("closed loop", queue=False))
    done: list[tuple[float, int]] = []

    def next_one(r: Request, now: float) -> None:
        done.append((now, r.prompt_tokens + r.max_tokens))
        replay._push(now, next(requests))

    replay.on_end = next_one
    replay.run([(0.0, next(requests)) for _ in range(concurrency)], until=duration)
    tokens = sum(cost for at, cost in done if warmup <= at < duration)
    return plan.throughput([at for at, _ in done], warmup, duration), tokens / (duration - warmup)


POLICIES = (
    Policy("noqueue", queue=False),
    Policy("queue, backfill 0.5 s", backfill_seconds=0.5),
    Policy("queue (default: backfill 1 s)"),
    Policy("queue, exact blocks", paged_margin=False),
    Policy("queue, the gateway's picker on pages", picker=True),
)


def replay_seed(pool: Pool, seed: int, overload: float, seconds: float) -> tuple[float, list[Outcome]]:
    mix = plan.Mix()
    rate, tokens_per_s = capacity(pool, seed, mix)
    requests = plan.arrivals(seed, "ovl", overload * rate, seconds, mix)
    outcomes = []
    for policy in POLICIES:
        replay = (PickerReplay if policy.picker else Replay)(pool, policy, tokens_per_s)
        replay.run([(r.at, r) for r in requests])
        outcomes.append(replay.outcome(requests))
    return rate, outcomes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="1,2,3,4,5")
    p.add_argument("--overload", type=float, default=1.15)
    p.add_argument("--overload-s", type=float, default=30.0)
    p.add_argument("--no-write", action="store_true", help="print the section instead of writing docs")
    args = p.parse_args()
    pool = Pool()
    rows: list[list[object]] = []
    served: dict[str, list[float]] = {policy.name: [] for policy in POLICIES}
    for seed in (int(s) for s in args.seeds.split(",")):
        rate, outcomes = replay_seed(pool, seed, args.overload, args.overload_s)
        for policy, o in zip(POLICIES, outcomes, strict=True):
            served[policy.name].append(o.served_pct)
            p95 = f"{1000 * o.ttft_p95:.0f}" if o.ttft_p95 is not None else "-"
            rows.append([seed, f"{rate:.2f}", f"`{policy.name}`", f"{o.served_pct:.1f}%", p95, o.preemptions])
            print(*rows[-1], flush=True)
    body = (
        "The overload scenario's schedules (benchmarks/overload/run.py, scenario 1) replayed offline through "
        "the simulator's engine, with a gateway that knows every sequence's exact progress (no pages, no "
        "network): what each queue policy serves at most without preempting. Capacity: run.py's closed loop, "
        f"replayed. {args.overload:g}x it for {args.overload_s:g} s.\n\n"
        + table(["seed", "capacity req/s", "policy", "served", "TTFT p95 ms", "preemptions"], rows)
        + "\n\nServed, mean over the seeds:\n\n"
        + table(["policy", "served"], [[f"`{name}`", f"{sum(v) / len(v):.1f}%"] for name, v in served.items()])
        + "\n\nThe first three queue rows know every sequence's progress at every step; the last is the "
        "gateway's own picker (modeldock.picking, default routing) learning the engines from their pages, "
        "read every 0.5 s and after each ending, as the scraper does. The real gateway (the `overload` "
        "section) adds Envoy, HTTP and a shared CPU to that. One seed's figures move by a point or two with "
        "any small change (which request meets which free slot); compare policies over the seeds."
    )
    command = ".venv/bin/python -m benchmarks.overload.ceiling" + (f" --seeds {args.seeds}" if args.seeds != "1,2,3,4,5"
                                                                  else "")
    if args.no_write:
        print(body)
    else:
        write_section("ceiling", "Overload ceiling: the queue's policy with exact knowledge (offline replay)",
                      command, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
