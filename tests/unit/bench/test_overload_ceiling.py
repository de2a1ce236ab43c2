"""The offline replay (benchmarks/overload/ceiling.py): its fit check against the simulator's engine
it drives, and the replay's outcomes on a short schedule."""

from __future__ import annotations

import random

import pytest

from benchmarks.overload import plan
from benchmarks.overload.ceiling import PickerReplay, Policy, Pool, Replay, capacity, fits

POOL = Pool(backends=1, num_gpu_blocks=16)  # 256 tokens, 4 sequences


@pytest.mark.timeout(10)
@pytest.mark.parametrize("paged_margin", [False, True], ids=["exact blocks", "paged margin"])
def test_what_fits_runs_to_its_end_without_a_preemption(paged_margin: bool) -> None:
    rng = random.Random(7)
    admitted = 0
    for _ in range(300):
        engine = POOL.engines()[0]
        for i in range(rng.randint(0, 3)):  # a batch built the same way, at random points of its progress
            prompt, output = rng.randint(1, 80), rng.randint(1, 60)
            if fits(engine, prompt, output, POOL, paged_margin=False):
                engine.add(f"s{i}", prompt, output)
            for _ in range(rng.randint(0, 20)):
                engine.step()
        assert engine.preemptions == 0
        prompt, output = rng.randint(1, 120), rng.randint(1, 80)
        if not fits(engine, prompt, output, POOL, paged_margin):
            continue
        admitted += 1
        engine.add("new", prompt, output)
        while engine.has_work():
            engine.step()
        assert engine.preemptions == 0
    assert admitted > 50  # the check admits, not only refuses


@pytest.mark.timeout(10)
def test_a_request_fits_beside_one_that_ends_before_it_has_grown() -> None:
    engine = POOL.engines()[0]
    engine.add("long", 100, 100)
    for _ in range(90):  # 190 tokens held, 10 steps left
        engine.step()
    # At its 10th step the long one holds 199 tokens (13 blocks): 3 blocks left for the new one's 39 + 9.
    assert fits(engine, 39, 40, POOL, paged_margin=False)  # then the long one is gone before it grows more
    assert not fits(engine, 40, 40, POOL, paged_margin=False)  # 49 tokens: a 4th block
    assert not fits(engine, 39, 40, POOL, paged_margin=True)  # 15 tokens kept for each part-empty last block
    empty = POOL.engines()[0]
    assert fits(empty, 200, 57, POOL, paged_margin=False)  # its last step holds 256: the whole cache
    assert not fits(empty, 200, 58, POOL, paged_margin=False)


@pytest.mark.timeout(60)
def test_the_queue_serves_without_preempting_where_no_queue_preempts() -> None:
    pool, mix = Pool(), plan.Mix()
    rate, tokens_per_s = capacity(pool, 1, mix, warmup=2.0, duration=12.0)
    assert 10 < rate < 25 and tokens_per_s > 200 * rate  # every request holds 64+ prompt tokens and 32+ output
    requests = plan.arrivals(1, "ovl", 1.15 * rate, 10.0, mix)
    outcomes = {}
    for policy in (Policy("noqueue", queue=False), Policy("queue"), Policy("picker", picker=True)):
        replay = (PickerReplay if policy.picker else Replay)(pool, policy, tokens_per_s)
        replay.run([(r.at, r) for r in requests])
        outcomes[policy.name] = replay.outcome(requests)
    assert outcomes["noqueue"].served == len(requests) and outcomes["noqueue"].preemptions > 0
    for name in ("queue", "picker"):  # the gateway's picker on pages keeps to the cache as well
        assert outcomes[name].preemptions == 0
        assert 0.5 * len(requests) < outcomes[name].served < len(requests)  # sheds some, serves most
