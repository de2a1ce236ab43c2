"""Prefix affinity: block hashes of a prompt, the index of who saw them, and how they
move picks without overriding load."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modeldock.clock import FakeClock
from modeldock.picking import Picker
from modeldock.picking.affinity import PrefixAffinity
from modeldock.picking.prefix import BLOCK_CHARS, MAX_BLOCKS, OWNERS_PER_BLOCK, PrefixIndex, prompt_blocks
from modeldock.picking.signals import Sample
from modeldock.types import Endpoint

A, B, C, D = (Endpoint("10.0.0.1", p) for p in (1, 2, 3, 4))
SHARED = "system: you are a careful assistant. " * 60  # about 2,200 characters


def chat(*contents: str) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}


def test_blocks_are_chained_whole_blocks_of_the_prompt() -> None:
    short = prompt_blocks({"prompt": "x" * (BLOCK_CHARS - 1)})
    assert short == ()
    one, two = prompt_blocks({"prompt": "x" * BLOCK_CHARS}), prompt_blocks({"prompt": "x" * (2 * BLOCK_CHARS)})
    assert len(one) == 1 and len(two) == 2 and two[0] == one[0]
    # Chained: the same block text after a different beginning hashes differently.
    assert two[1] != one[0]
    assert len(prompt_blocks({"prompt": "y" * (BLOCK_CHARS * (MAX_BLOCKS + 10))})) == MAX_BLOCKS


def test_chat_and_completion_prompts_share_blocks_only_with_the_same_beginning() -> None:
    a = prompt_blocks(chat(SHARED + "question one"))
    b = prompt_blocks(chat(SHARED + "a different question, long enough to fill more blocks" * 20))
    common = len(SHARED) // BLOCK_CHARS
    assert a[:common] == b[:common]
    assert prompt_blocks(chat("other " + SHARED))[:1] != a[:1]
    # Roles and message boundaries are part of the text.
    assert prompt_blocks({"messages": [{"role": "system", "content": SHARED}]})[:1] != a[:1]
    # Text content parts count; other parts and malformed messages are skipped, never raise.
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": SHARED + "question one"},
                                                       {"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert prompt_blocks(parts) == a
    assert prompt_blocks({"messages": [1, None, {"content": 7}]}) == ()
    assert prompt_blocks({"prompt": [SHARED, "ignored"]}) == prompt_blocks({"prompt": SHARED})
    assert prompt_blocks({"prompt": [1, 2, 3]}) == ()


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=600),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.sampled_from(["messages", "prompt", "role", "content", "text", "x"]), inner, max_size=4),
                    max_leaves=20))
def test_prompt_blocks_never_raises(body: object) -> None:
    blocks = prompt_blocks(body if isinstance(body, dict) else {"prompt": body})
    assert isinstance(blocks, tuple) and len(blocks) <= MAX_BLOCKS


def test_index_counts_leading_blocks_per_candidate() -> None:
    index = PrefixIndex()
    blocks = prompt_blocks({"prompt": "p" * (BLOCK_CHARS * 8)})
    index.record(blocks[:3], A)
    index.record(blocks, B)
    assert index.matched(blocks, [A, B, C]) == {A: 3, B: 8}
    assert index.matched(blocks, [A, C]) == {A: 3}  # only candidates
    assert index.matched(blocks, [C, D]) == {}
    assert index.matched((), [A, B]) == {}
    other = prompt_blocks({"prompt": "q" * (BLOCK_CHARS * 8)})
    assert index.matched(other, [A, B]) == {}
    index.forget(B)
    assert index.matched(blocks, [A, B]) == {A: 3}


def test_index_is_bounded_and_keeps_the_most_recent_owners() -> None:
    index = PrefixIndex(capacity=10)
    for i in range(30):
        index.record(prompt_blocks({"prompt": f"{i:04d}" * BLOCK_CHARS}), A)
    assert len(index) == 10
    blocks = prompt_blocks({"prompt": "z" * BLOCK_CHARS})
    many = [Endpoint("10.0.1.1", 100 + i) for i in range(OWNERS_PER_BLOCK + 2)]
    for ep in many:
        index.record(blocks, ep)
    assert set(index.matched(blocks, many)) == set(many[2:])  # the oldest two are forgotten
    index.record(blocks, many[2])  # seen again: now the most recent
    index.record(blocks, many[0])
    assert set(index.matched(blocks, many)) == {*many[2:], many[0]} - {many[3]}
    with pytest.raises(ValueError, match="capacity"):
        PrefixIndex(0)


def picker(clock: FakeClock, prefix_weight: float = 0.5, **kwargs: object) -> Picker:
    p = Picker(clock, prefix_weight=prefix_weight, rng=random.Random(7), **kwargs)  # type: ignore[arg-type]
    p.set_endpoints("m", (A, B, C, D))
    return p


@pytest.fixture
def p(clock: FakeClock) -> Picker:
    """The usual affinity picker: prefix weight 0.5 over A, B, C and D, on the conftest's clock."""
    return picker(clock)


def sample(waiting: int = 0, running: int = 0, kv: float = 0.0) -> Sample:
    return Sample(waiting=waiting, running=running, kv=kv)


def test_a_shared_prefix_follows_the_endpoint_that_saw_it(p: Picker) -> None:
    groups = [prompt_blocks(chat(f"group {g} " + SHARED + "question")) for g in range(4)]
    first = {}
    for g, blocks in enumerate(groups):
        pick = p.pick("m", blocks)
        first[g] = pick.primary
        pick.lease.release()
    for _ in range(5):
        for g, blocks in enumerate(groups):
            pick = p.pick("m", blocks)
            assert pick.primary == first[g]
            pick.lease.release()


def test_without_affinity_the_same_prompts_spread() -> None:
    clock = FakeClock()
    p = picker(clock, prefix_weight=0.0)
    blocks = prompt_blocks(chat(SHARED))
    seen = set()
    for _ in range(8):
        pick = p.pick("m", blocks)
        seen.add(pick.primary)
        pick.lease.release()
    assert len(seen) == 4


def test_load_still_wins_over_affinity_when_the_preferred_endpoint_is_busy(p: Picker, clock: FakeClock) -> None:
    blocks = prompt_blocks(chat(SHARED))
    preferred = p.pick("m", blocks)
    preferred.lease.release()
    for ep in (A, B, C, D):
        p.observe(ep, sample(), clock.monotonic())
    # A long queue on the preferred endpoint: the prompt goes elsewhere.
    p.observe(preferred.primary, sample(waiting=40, running=64, kv=0.95), clock.monotonic())
    moved = p.pick("m", blocks)
    assert moved.primary != preferred.primary
    moved.lease.release()
    # A light load there does not outweigh a whole cached prefix.
    p.observe(preferred.primary, sample(waiting=0, running=4, kv=0.2), clock.monotonic())
    back = p.pick("m", blocks)
    assert back.primary in (preferred.primary, moved.primary)  # both have seen it now
    back.lease.release()


def test_affinity_is_only_for_the_default_policy_and_works_with_power_of_two_choices() -> None:
    clock = FakeClock()
    least = Picker(clock, policy="least_request", prefix_weight=1.0, rng=random.Random(1))
    least.set_endpoints("m", (A, B))
    blocks = prompt_blocks(chat(SHARED))
    picks = [least.pick("m", blocks) for _ in range(2)]
    assert {p.primary for p in picks} == {A, B}  # least_request ignores the prefix
    many = [Endpoint("10.1.0.1", 1000 + i) for i in range(40)]
    big = Picker(clock, prefix_weight=0.5, p2c_threshold=8, rng=random.Random(3))
    big.set_endpoints("m", many)
    first = big.pick("m", blocks)
    first.lease.release()
    for _ in range(10):
        again = big.pick("m", blocks)
        assert again.primary == first.primary  # drawn as a contender although 40 > p2c_threshold
        again.lease.release()


def test_endpoints_leaving_the_snapshot_are_forgotten(p: Picker) -> None:
    blocks = prompt_blocks(chat(SHARED))
    pick = p.pick("m", blocks)
    pick.lease.release()
    p.set_endpoints("m", tuple(ep for ep in (A, B, C, D) if ep != pick.primary))
    affinity = p.request_scorer("prefix")
    assert isinstance(affinity, PrefixAffinity) and affinity.index.matched(blocks, [pick.primary]) == {}


def test_a_prefix_every_request_shares_spreads_over_all_endpoints() -> None:
    """A global system prompt must not pile every request onto the first endpoint that saw it."""
    clock = FakeClock()
    eps = [Endpoint("10.2.0.1", 2000 + i) for i in range(8)]
    p = Picker(clock, prefix_weight=0.25, rng=random.Random(5))
    p.set_endpoints("m", eps)
    leases = []
    for i in range(64):  # all held in flight: only the in-flight count tells load apart
        leases.append(p.pick("m", prompt_blocks(chat(SHARED + f"user question {i} " * 40))).lease)
    counts = [p.in_flight(ep) for ep in eps]
    assert min(counts) >= 4 and max(counts) <= 12, counts
    for lease in leases:
        lease.release()
