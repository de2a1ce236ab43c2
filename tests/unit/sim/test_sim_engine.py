"""The engine alone: batching, chunked prefill, preemption, prefix caching, cancellation."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modeldock.sim.config import SimConfig
from modeldock.sim.engine import Engine, StepResult, TokenOut
from modeldock.sim.tokens import text_prompt, token_ids_prompt


def engine(**fields: Any) -> Engine:
    return Engine(SimConfig(**fields))


def run_until_idle(e: Engine, limit: int = 10_000) -> list[StepResult]:
    steps = []
    while e.has_work():
        steps.append(e.step())
        assert len(steps) < limit, "engine made no progress"
    return steps


def first_tokens(steps: list[StepResult]) -> list[str]:
    return [o.request_id for s in steps for o in s.outputs if o.index == 0]


def test_running_batch_is_capped_by_max_num_seqs_and_queue_is_fifo() -> None:
    e = engine(max_num_seqs=2)
    for i in range(5):
        e.add(f"r{i}", prompt_tokens=10, max_tokens=3)
    first = e.step()
    assert (e.num_running, e.num_waiting) == (2, 3)
    assert [o.request_id for o in first.outputs] == ["r0", "r1"]
    steps = [first, *run_until_idle(e)]
    assert max(s.num_scheduled for s in steps) == 2
    assert first_tokens(steps) == ["r0", "r1", "r2", "r3", "r4"]
    assert e.completed == 5


def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    e = engine(max_num_batched_tokens=100, max_model_len=1000)
    e.add("long", prompt_tokens=250, max_tokens=2)
    chunks = [e.step() for _ in range(4)]
    assert [s.prefill_tokens for s in chunks] == [100, 100, 50, 0]
    assert [s.decode_seqs for s in chunks] == [0, 0, 0, 1]
    assert [s.outputs for s in chunks] == [
        [],
        [],
        [TokenOut("long", 0, None)],
        [TokenOut("long", 1, "length")],
    ]
    assert not e.has_work()


def test_decodes_come_before_new_prefill_and_share_the_budget() -> None:
    e = engine(max_num_batched_tokens=64)
    for i in range(4):
        e.add(f"d{i}", prompt_tokens=8, max_tokens=10)
    assert e.step().prefill_tokens == 32
    e.add("big", prompt_tokens=200, max_tokens=1)
    step = e.step()
    assert step.decode_seqs == 4
    assert step.prefill_tokens == 60  # what the four decodes left of the 64-token budget
    assert [o.request_id for o in step.outputs] == ["d0", "d1", "d2", "d3"]


def test_step_time_follows_batch_composition() -> None:
    e = engine(max_num_batched_tokens=64, step_base_ms=5.0, prefill_token_ms=0.1, decode_seq_ms=1.0)
    for i in range(4):
        e.add(f"d{i}", prompt_tokens=8, max_tokens=10)
    first = e.step()
    assert first.duration_s == pytest.approx((5.0 + 0.1 * 32) / 1000)
    e.add("big", prompt_tokens=200, max_tokens=1)
    mixed = e.step()
    assert mixed.duration_s == pytest.approx((5.0 + 0.1 * 60 + 1.0 * 4) / 1000)
    assert e.sim_time == pytest.approx(first.duration_s + mixed.duration_s)
    idle = engine()
    assert idle.step().duration_s == 0.0


def test_full_cache_preempts_the_most_recent_sequence_which_recomputes_later() -> None:
    # 6 blocks of 4 tokens. Two 8-token prompts take 2 blocks each; decoding grows both
    # until the first needs a block nobody has.
    e = engine(block_size=4, num_gpu_blocks=6, max_model_len=24)
    e.add("A", prompt_tokens=8, max_tokens=12)
    e.add("B", prompt_tokens=8, max_tokens=12)
    steps: list[StepResult] = []
    while not any(s.preempted for s in steps):
        steps.append(e.step())
        assert len(steps) < 20
    assert steps[-1].preempted == ["B"]
    assert [s.request_id for s in e.running] == ["A"]
    assert e.waiting[0].request_id == "B" and e.waiting[0].blocks == []
    assert e.preemptions == 1
    produced_before = sum(1 for s in steps for o in s.outputs if o.request_id == "B")

    rest = run_until_idle(e)
    # B comes back once A is done, recomputing its prompt and the tokens it had produced.
    resume = next(s for s in rest if any(o.request_id == "B" for o in s.outputs))
    assert resume.prefill_tokens == 8 + produced_before
    for rid in ("A", "B"):
        indexes = [o.index for s in steps + rest for o in s.outputs if o.request_id == rid]
        assert indexes == list(range(12))
    assert e.kv_usage == 0.0 and e.completed == 2


def test_shared_prefix_skips_cached_blocks() -> None:
    e = engine()
    prompt = text_prompt("x" * 200, block_size=16)  # 50 tokens: 3 full blocks
    assert prompt.num_tokens == 50 and len(prompt.block_hashes) == 3
    e.add("a", prompt.num_tokens, 1, prompt.block_hashes)
    first = e.step()
    assert (first.prefill_tokens, first.prefix_queries, first.prefix_hits) == (50, 50, 0)
    e.add("b", prompt.num_tokens, 1, prompt.block_hashes)
    second = e.step()
    assert (second.prefill_tokens, second.prefix_queries, second.prefix_hits) == (2, 50, 48)
    assert (e.prefix_queries, e.prefix_hits) == (100, 48)


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    e = engine()
    prompt = text_prompt("y" * 192, block_size=16)  # exactly 48 tokens, 3 full blocks
    e.add("a", prompt.num_tokens, 1, prompt.block_hashes)
    e.step()
    e.add("b", prompt.num_tokens, 1, prompt.block_hashes)
    step = e.step()
    assert step.prefix_hits == 32 and step.prefill_tokens == 16


def test_different_prompts_do_not_hit_and_caching_can_be_off() -> None:
    e = engine()
    a = text_prompt("a" * 200, 16)
    b = text_prompt("b" * 200, 16)
    e.add("a", a.num_tokens, 1, a.block_hashes)
    e.step()
    e.add("b", b.num_tokens, 1, b.block_hashes)
    assert e.step().prefix_hits == 0

    off = engine(enable_prefix_caching=False)
    for rid in ("x", "y"):
        off.add(rid, a.num_tokens, 1, a.block_hashes)
        step = off.step()
        assert step.prefill_tokens == 50 and step.prefix_queries == 0
    assert off.kv.num_cached == 0


def test_cached_blocks_are_evicted_least_recently_freed_first_tail_before_head() -> None:
    e = engine(block_size=16, num_gpu_blocks=6, max_model_len=96)
    a = token_ids_prompt(list(range(100, 133)), 16)  # 33 tokens: 3 blocks, 2 of them full
    b = token_ids_prompt(list(range(200, 233)), 16)
    c = token_ids_prompt(list(range(300, 365)), 16)  # 65 tokens: 5 blocks
    for rid, prompt in (("a", a), ("b", b), ("c", c)):
        e.add(rid, prompt.num_tokens, 1, prompt.block_hashes)
        run_until_idle(e)
    # c needed 5 of 6 blocks: it evicted all of a (freed first), then b's tail block.
    e.add("b2", b.num_tokens, 1, b.block_hashes)
    assert e.step().prefix_hits == 16
    e.add("a2", a.num_tokens, 1, a.block_hashes)
    assert e.step().prefix_hits == 0


def test_abort_frees_blocks_at_once_in_running_and_waiting() -> None:
    e = engine(max_num_seqs=1)
    e.add("run", prompt_tokens=100, max_tokens=50)
    e.add("wait", prompt_tokens=100, max_tokens=50)
    e.step()
    assert e.kv_usage > 0 and (e.num_running, e.num_waiting) == (1, 1)
    assert e.abort("wait") and e.num_waiting == 0
    assert e.abort("run")
    assert e.kv_usage == 0.0 and not e.has_work()
    assert e.cancelled == 2 and e.completed == 0
    assert not e.abort("run") and not e.abort("never-seen")


def test_rejects_duplicate_ids_and_empty_requests() -> None:
    e = engine()
    e.add("x", 5, 1)
    with pytest.raises(ValueError):
        e.add("x", 5, 1)
    with pytest.raises(ValueError):
        e.add("y", 0, 1)
    with pytest.raises(ValueError):
        e.add("z", 5, 0)


def test_config_refuses_a_model_len_the_cache_cannot_hold() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        SimConfig(block_size=16, num_gpu_blocks=10, max_model_len=161)
    with pytest.raises(ValueError):
        SimConfig(speed=0)


requests_strategy = st.lists(
    st.tuples(
        st.integers(0, 2),  # which shared prefix
        st.integers(0, 60),  # prefix length used
        st.integers(1, 40),  # own tokens
        st.integers(1, 12),  # max_tokens
        st.one_of(st.none(), st.integers(0, 30)),  # step at which to abort, if any
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(
    requests=requests_strategy,
    max_num_seqs=st.integers(1, 8),
    budget=st.integers(8, 96),
    spare_blocks=st.integers(0, 20),
    caching=st.booleans(),
)
def test_invariants_hold_under_random_load(
    requests: list[tuple[int, int, int, int, int | None]],
    max_num_seqs: int,
    budget: int,
    spare_blocks: int,
    caching: bool,
) -> None:
    block_size = 4
    max_model_len = 120
    e = engine(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        block_size=block_size,
        num_gpu_blocks=max_model_len // block_size + spare_blocks,
        max_model_len=max_model_len,
        enable_prefix_caching=caching,
    )
    prefixes = [list(range(k * 1000, k * 1000 + 60)) for k in range(3)]
    wanted: dict[str, int] = {}
    aborts: dict[int, list[str]] = {}
    for i, (which, shared, own, max_tokens, abort_at) in enumerate(requests):
        ids = prefixes[which][:shared] + [10_000 + i * 100 + j for j in range(own)]
        prompt = token_ids_prompt(ids, block_size)
        e.add(f"r{i}", prompt.num_tokens, max_tokens, prompt.block_hashes)
        wanted[f"r{i}"] = max_tokens
        if abort_at is not None:
            aborts.setdefault(abort_at, []).append(f"r{i}")

    seen: dict[str, list[int]] = {rid: [] for rid in wanted}
    finished: set[str] = set()
    aborted: set[str] = set()
    step_no = 0
    while e.has_work():
        for rid in aborts.get(step_no, []):
            if e.abort(rid):
                aborted.add(rid)
        step = e.step()
        step_no += 1
        assert step_no < 5_000, "engine made no progress"
        assert step.prefill_tokens + step.decode_seqs <= budget
        assert e.num_running <= max_num_seqs
        # Every reference count is exactly the number of running sequences holding the block.
        holders = Counter(b for s in e.running for b in s.blocks)
        assert all(e.kv._refs[b] == holders.get(b, 0) for b in range(e.kv.num_blocks))
        assert len(holders) + e.kv.num_free == e.kv.num_blocks
        assert all(not s.blocks for s in e.waiting)
        for out in step.outputs:
            seen[out.request_id].append(out.index)
            if out.finish_reason is not None:
                finished.add(out.request_id)

    assert e.kv_usage == 0.0
    assert e.completed + e.cancelled == len(wanted)
    assert finished.isdisjoint(aborted) and finished | aborted == set(wanted)
    for rid, indexes in seen.items():
        assert indexes == list(range(len(indexes))), f"{rid} tokens out of order: {indexes}"
        if rid in finished:
            assert len(indexes) == wanted[rid]
