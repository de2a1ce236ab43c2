"""Microbenchmark: µs per parsed vLLM page and per pick (+ release), per policy; and the room rule's
tokens check with the request's output limit known (the growth bound, `saturation.held_tokens`) against
unknown (the committed tokens alone), side by side; and that bound against the step-by-step one
(`saturation.fits_as_they_finish`) by requests on the endpoint; and prompt blocks + pick with prefix
affinity, before prefix homes against with them (`prefix_rows`). With `--scale`: pick latency and the
picker's memory per endpoint at 10, 100 and 1,000 endpoints of one model (`scale_section`).

    .venv/bin/python -m benchmarks.picking            # prints
    .venv/bin/python -m benchmarks.picking --write    # also writes the `picking-room` section of docs/benchmarks.md
    .venv/bin/python -m benchmarks.picking --scale [--write]   # only the scale rows (section `picking-scale`)
"""

from __future__ import annotations

import gc
import random
import sys
import time
import tracemalloc

from benchmarks._report import table, write_section
from modeldock.clock import SystemClock
from modeldock.picking.ledger import Lease
from modeldock.picking.picker import Picker
from modeldock.types import Endpoint
from tests.support.vllm_page import vllm_metrics_page


def time_parse(text: str | None = None, model: str = "/models/meta-llama/Llama-3.3-70B-Instruct",
               rounds: int = 2000) -> float:
    """Mean µs for one `parse_metrics` call on `text` (default: the fixture page)."""
    from modeldock.picking.parse import parse_metrics

    page = text if text is not None else vllm_metrics_page(model)
    parse_metrics(page, model)
    start = time.perf_counter()
    for _ in range(rounds):
        parse_metrics(page, model)
    return (time.perf_counter() - start) / rounds * 1e6


def time_pick(endpoints: int = 8, policy: str = "default", rounds: int = 20000, metrics: bool = True) -> float:
    """Mean µs for one pick plus one release over `endpoints` endpoints with
    fresh samples, with metrics exported to a private registry when `metrics`."""
    from prometheus_client import CollectorRegistry

    from modeldock.picking.picker import Picker
    from modeldock.picking.signals import Sample

    clock = SystemClock()
    registry = CollectorRegistry() if metrics else None
    picker = Picker(clock, policy=policy, rng=random.Random(1), registry=registry)
    eps = [Endpoint(f"10.0.0.{i + 1}", 8000) for i in range(endpoints)]
    picker.set_endpoints("m", eps)
    for i, ep in enumerate(eps):
        picker.observe(ep, Sample(waiting=i % 3, running=10 + i, kv=0.1 * (i % 5)), clock.monotonic())
    leases: list[Lease] = []
    start = time.perf_counter()
    for _ in range(rounds):
        leases.append(picker.pick("m").lease)
        if len(leases) > 64:  # keep in-flight realistic: release the oldest
            leases.pop(0).release()
    elapsed = time.perf_counter() - start
    return elapsed / rounds * 1e6


def _blocks_before(body: dict[str, object]) -> tuple[int, ...]:
    """prefix.prompt_blocks before prefix homes: every block chained with Python's hash (salted per process)."""
    from modeldock.picking.prefix import BLOCK_CHARS, MAX_BLOCKS, _prompt_text

    text = _prompt_text(body)
    blocks, h = [], 0
    for start in range(0, min(len(text), BLOCK_CHARS * MAX_BLOCKS) - BLOCK_CHARS + 1, BLOCK_CHARS):
        h = hash((h, text[start:start + BLOCK_CHARS]))
        blocks.append(h)
    return tuple(blocks)


def time_prefix_pick(endpoints: int = 8, cold: bool = True, homing: bool = True, rounds: int = 2000) -> float:
    """Mean µs for the prompt's block hashes of a chat request (a 2,400-character system prompt) plus one
    pick and release with prefix affinity at its default weight: `cold`, every prompt's beginning new (no
    record: with `homing` the prefix's home is computed), else 8 prefixes that recur (the table decides).
    `homing=False` is the rule before (all blocks by Python's hash, no opinion without a record)."""
    from modeldock.picking.affinity import PrefixAffinity
    from modeldock.picking.picker import Picker
    from modeldock.picking.prefix import prompt_blocks
    from modeldock.picking.signals import Sample

    clock = SystemClock()
    picker = Picker(clock, prefix_weight=0.25, rng=random.Random(1))
    affinity = picker.request_scorer("prefix")
    assert isinstance(affinity, PrefixAffinity)
    affinity.homing = homing
    blocks_of = prompt_blocks if homing else _blocks_before
    eps = [Endpoint(f"10.0.0.{i + 1}", 8000) for i in range(endpoints)]
    picker.set_endpoints("m", eps)
    for i, ep in enumerate(eps):
        picker.observe(ep, Sample(waiting=i % 3, running=10 + i, kv=0.1 * (i % 5)), clock.monotonic())
    system = "You answer from the attached document only, citing it. " * 44
    bodies: list[dict[str, object]] = [
        {"model": "m", "messages": [{"role": "system", "content": f"{i if cold else i % 8} {system}"},
                                    {"role": "user", "content": f"question {i}"}]} for i in range(rounds)]
    start = time.perf_counter()
    for body in bodies:
        picker.pick("m", blocks_of(body)).lease.release()
    return (time.perf_counter() - start) / rounds * 1e6


def prefix_rows(rounds: int = 9) -> list[list[object]]:
    """Before against prefix homes, per pool size and prompt kind; best of `rounds` alternating runs."""
    rows: list[list[object]] = []
    for n in (8, 64):
        for cold in (True, False):
            before, after = [], []
            for _ in range(rounds):  # alternating, best of: noise only adds
                before.append(time_prefix_pick(n, cold, homing=False))
                after.append(time_prefix_pick(n, cold, homing=True))
            a, b = min(before), min(after)
            rows.append([str(n), "new" if cold else "recurring", f"{a:.2f}", f"{b:.2f}", f"{b / a:.2f}x"])
    return rows


def time_room_pick(endpoints: int, output: int | None, rounds: int = 20000) -> float:
    """Mean µs for one pick plus one release with saturation by room on: every endpoint's KV capacity
    and speed known and its sample fresh (so the tokens rule runs in full), nothing saturated."""
    from modeldock.picking.picker import Picker
    from modeldock.picking.saturation import Saturation
    from modeldock.picking.signals import Sample

    clock = SystemClock()
    picker = Picker(clock, rng=random.Random(1), saturation=Saturation(room=True))
    eps = [Endpoint(f"10.0.0.{i + 1}", 8000) for i in range(endpoints)]
    picker.set_endpoints("m", eps)
    now = clock.monotonic()
    for i, ep in enumerate(eps):
        for at, total in ((now - 1.0, 0.0), (now, 5000.0)):  # two pages: the speed is learned
            picker.observe(ep, Sample(waiting=0, running=2 + i % 3, kv=0.1 * (i % 5), capacity=10.0**9,
                                      tokens_total=total), at)
    leases: list[Lease] = []
    start = time.perf_counter()
    for _ in range(rounds):
        leases.append(picker.pick("m", cost=300, output=output).lease)
        if len(leases) > 64:
            leases.pop(0).release()
    return (time.perf_counter() - start) / rounds * 1e6


def time_bound(leases: int, finishing: bool, rounds: int = 20000) -> float:
    """Mean µs for one tokens-rule bound on an endpoint with `leases` requests of known output
    limit (four in five short): `held_tokens` alone, or `fits_as_they_finish` (the step-by-step
    bound run when the first says no)."""
    from modeldock.picking.saturation import fits_as_they_finish, held_tokens
    from modeldock.picking.signals import Signals

    ends = sorted(((32 if i % 5 else 256), 400) for i in range(leases))
    capacity = 400.0 * leases
    s = Signals(fresh=True, sample=None, running=float(leases), kv=0.5, age=0.1, in_flight=leases,
                committed=400 * leases, ends=ends, capacity=capacity, speed=1000.0, growth=100.0)
    start = time.perf_counter()
    if finishing:
        for _ in range(rounds):
            fits_as_they_finish(s, 600, 256, capacity)
    else:
        for _ in range(rounds):
            held_tokens(s, 256)
    return (time.perf_counter() - start) / rounds * 1e6


def room_section(rounds: int = 3) -> str:
    rows = []
    for n in (8, 64):
        unknown, known = [], []
        for _ in range(rounds):  # alternating, best of: noise only adds
            unknown.append(time_room_pick(n, None))
            known.append(time_room_pick(n, 32))
        a, b = min(unknown), min(known)
        rows.append([str(n), f"{a:.2f}", f"{b:.2f}", f"{b / a:.2f}x"])
    bounds = []
    for n in (8, 64, 256):
        held, finish = [], []
        for _ in range(rounds):
            held.append(time_bound(n, False))
            finish.append(time_bound(n, True))
        a, b = min(held), min(finish)
        bounds.append([str(n), f"{a:.2f}", f"{b:.2f}", f"{b / a:.1f}x"])
    return (
        "µs per pick + release with saturation by room (`default` policy, capacity and speed known, fresh samples, "
        "64 requests in flight), the request's output limit unknown (the tokens rule reads the committed tokens) "
        f"against known (it also bounds what the others grow while it runs, `saturation.held_tokens`); best of "
        f"{rounds} alternating rounds.\n\n"
        + table(["endpoints", "output unknown", "output known", "known / unknown"], rows)
        + "\n\nµs per tokens-rule bound on one endpoint with N requests of known output limit (four in five short): "
        "`held_tokens` (every pick with the output known) against `fits_as_they_finish` (the step-by-step bound, "
        "run only where the first refuses); best of " + f"{rounds} alternating rounds.\n\n"
        + table(["requests there", "held_tokens", "fits_as_they_finish", "ratio"], bounds)
    )


SCALE_SIZES = (10, 100, 1000)


def _scaled_picker(endpoints: int) -> tuple[Picker, list[Lease]]:
    """A picker as `build_picker` makes it from the default config (saturation by room, p2c above 32,
    prefix affinity on), `endpoints` endpoints of one model, each with two pages (capacity and speed
    known) and 64 requests in flight over the pool."""
    from modeldock.picking.config import RoutingConfig
    from modeldock.picking.factory import build_picker
    from modeldock.picking.signals import Sample

    clock = SystemClock()
    picker = build_picker(RoutingConfig(), clock, None, rng=random.Random(1))
    eps = [Endpoint(f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}", 8000) for i in range(endpoints)]
    picker.set_endpoints("m", eps)
    now = clock.monotonic()
    for i, ep in enumerate(eps):
        for at, total in ((now - 1.0, 0.0), (now, 5000.0)):
            picker.observe(ep, Sample(waiting=0, running=2 + i % 3, kv=0.1 * (i % 5), capacity=10.0**9,
                                      tokens_total=total, generated_total=total / 2), at)
    leases = [picker.pick("m", cost=300, output=32).lease for _ in range(64)]
    return picker, leases


def time_scaled_pick(endpoints: int, rounds: int = 20000, prefixes: bool = False) -> float:
    """Mean µs for one pick plus one release on `_scaled_picker(endpoints)` (64 in flight throughout);
    `prefixes`: each request with prompt blocks nobody has seen (so the prefix's home is computed over the pool)."""
    from modeldock.picking.prefix import prompt_blocks

    picker, leases = _scaled_picker(endpoints)
    pick = picker.pick
    system = "You answer from the attached document only, citing it. " * 10
    blocks = [prompt_blocks({"model": "m", "messages": [{"role": "system", "content": f"{i} {system}"}]})
              if prefixes else () for i in range(rounds)]
    start = time.perf_counter()
    for prefix in blocks:
        leases.append(pick("m", prefix, cost=300, output=32).lease)
        leases.pop(0).release()
    return (time.perf_counter() - start) / rounds * 1e6


def picker_bytes(endpoints: int) -> int:
    """Bytes the picker of `_scaled_picker(endpoints)` holds (tracemalloc: what building it and 2,000 picks left
    allocated), including its leases."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    picker, leases = _scaled_picker(endpoints)
    pick = picker.pick
    for _ in range(2000):
        leases.append(pick("m", cost=300, output=32).lease)
        leases.pop(0).release()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del picker, leases
    return held


def scale_section(rounds: int = 5) -> str:
    times: dict[tuple[int, bool], list[float]] = {(n, p): [] for n in SCALE_SIZES for p in (False, True)}
    for r in range(rounds):  # alternating, reversed every other round; best of: noise only adds
        for n in (SCALE_SIZES if r % 2 == 0 else SCALE_SIZES[::-1]):
            for prefixes in (False, True):
                times[(n, prefixes)].append(time_scaled_pick(n, 5000 if prefixes else 20000, prefixes))
    memory = {n: picker_bytes(n) for n in SCALE_SIZES}
    base = {p: min(times[(SCALE_SIZES[0], p)]) for p in (False, True)}
    rows: list[list[object]] = []
    for n in SCALE_SIZES:
        best, cold = min(times[(n, False)]), min(times[(n, True)])
        marginal = "-" if n == SCALE_SIZES[0] else (
            f"{(memory[n] - memory[SCALE_SIZES[0]]) / (n - SCALE_SIZES[0]) / 1024:.1f}")
        rows.append([f"{n:,}", "all" if n <= 32 else "p2c", f"{best:.1f}", f"{best / base[False]:.2f}x",
                     f"{cold:.1f}", f"{cold / base[True]:.2f}x",
                     f"{memory[n] / 1024:.0f}", f"{memory[n] / n / 1024:.1f}", marginal])
    return (
        "One model's endpoints, the picker `build_picker` makes from the default config (saturation by room, "
        "power of two choices above `p2c_threshold` 32, prefix affinity on, no prompt blocks), every endpoint "
        "with two pages (KV capacity and speed known) and 64 requests in flight: µs per pick + release, best of "
        f"{rounds} alternating rounds of 20,000 (5,000 with a new prompt prefix each: its home, by rendezvous "
        "hashing, is computed over every endpoint of the model), and what the picker holds (tracemalloc, after "
        "2,000 picks; the marginal KiB per endpoint is over the 10-endpoint picker).\n\n"
        + table(["endpoints", "scored", "pick + release µs", "vs 10", "new prefix µs", "vs 10", "picker KiB",
                 "KiB per endpoint", "marginal KiB per endpoint"], rows)
        + f"\n\nReading: above 32 endpoints power of two choices scores `fallbacks + 2` candidates whatever the "
        f"pool, so a pick at {SCALE_SIZES[-1]:,} costs {rows[-1][3]} of one at 10 (fewer than 10 scored). A prompt "
        f"whose beginning nobody has seen costs {rows[-1][5]}: its home (`prefix.home_index`) is the highest "
        "rendezvous weight over every endpoint of the model, one multiplication each (O(endpoints), the price of "
        "every replica choosing the same home); a recurring prefix is decided by the table and costs as a pick. "
        f"Memory grows by about {rows[-1][8]} KiB per endpoint (its `Load`, its samples' state, the prefix "
        "multipliers): a 1,000-endpoint model holds under 2 MiB."
    )


def main() -> None:
    if "--scale" in sys.argv[1:]:
        body = scale_section()
        print(body)
        if "--write" in sys.argv[1:]:
            write_section("picking-scale", "Picking at 1,000 endpoints per model: latency and memory",
                          ".venv/bin/python -m benchmarks.picking --scale --write", body)
        return
    page = vllm_metrics_page()
    print(f"page: {len(page.encode()) / 1024:.1f} KiB, {page.count(chr(10))} lines")
    print(f"parse_metrics: {time_parse(page):.1f} µs/page")
    for policy in ("default", "seed", "least_request", "round_robin"):
        for n in (8, 64):
            with_metrics = time_pick(n, policy)
            bare = time_pick(n, policy, metrics=False)
            print(f"pick+release {policy:>13} n={n:<3}: {with_metrics:5.2f} µs ({bare:5.2f} µs without metrics)")
    print("prompt blocks + pick+release with prefix affinity, µs (before homes / with them):")
    print(table(["endpoints", "prefixes", "before", "homes", "ratio"], prefix_rows()))
    body = room_section()
    print(body)
    if "--write" in sys.argv[1:]:
        write_section("picking-room", "Picking: the tokens rule with the output limit known",
                      ".venv/bin/python -m benchmarks.picking --write", body)


if __name__ == "__main__":
    main()
