"""The tokens rule with the output limit known: a short request joins long ones whose full limits
would not fit together, because none of them can grow by more than its own output while it runs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from modeldock.picking.saturation import Saturation, held_tokens
from modeldock.picking.signals import Signals

ROOM = Saturation(room=True, kv_full=1.0)
CAPACITY = 1800.0


def _signals(*, running: float = 3, kv: float = 0.5, committed: int = 1500, fresh: bool = True,
             speed: float = 400.0, age: float = 0.0, new_tokens: int = 0, waiting: float = 0.0,
             new_outputs: int = 0) -> Signals:
    return Signals(int(running + waiting), fresh, waiting if fresh else 0.0, running if fresh else 0.0,
                   kv if fresh else 0.0, None, committed, CAPACITY, speed, new_tokens, 0.0, 0.0, 0, age, new_outputs)


def test_a_short_request_fits_where_the_full_limits_would_not() -> None:
    s = _signals()  # 900 tokens held now by three sequences, 1500 committed at their limits
    assert ROOM.over(s, cost=400)  # output unknown: the committed limits decide (1500 + 400 > 1800)
    assert not ROOM.over(s, cost=400, output=32)  # 900 + 3 x 32 + 400 fits
    assert ROOM.over(s, cost=400, output=256)  # 900 + 3 x 256 + 400 does not: long enough to meet them


def test_the_committed_limits_still_bound_what_is_held() -> None:
    s = _signals(kv=0.9, committed=1000)  # others' sequences (not ours) hold KV too
    assert held_tokens(s, 32) == 1000


def test_what_was_produced_since_the_sample_counts_at_the_learned_speed() -> None:
    assert not ROOM.over(_signals(age=0.2), cost=400, output=32)  # + 80 tokens
    assert ROOM.over(_signals(age=1.2), cost=400, output=32)  # + 480 tokens


def test_picks_since_the_sample_count_whole_and_as_growing_sequences() -> None:
    s = _signals(new_tokens=300, waiting=1)
    assert held_tokens(s, 32) == 900 + 300 + 4 * 32


def test_picks_since_the_sample_hold_their_prompts_when_their_outputs_are_known() -> None:
    # 300 committed, 100 of it an output limit: 200 of prompt enter the cache, the output grows
    # like every other sequence (counted by the output term, once).
    s = _signals(new_tokens=300, new_outputs=100, waiting=1)
    assert held_tokens(s, 32) == 900 + 200 + 4 * 32


def test_stale_samples_or_unknown_speed_fall_back_to_the_committed_limits() -> None:
    assert held_tokens(_signals(fresh=False), 32) == 1500
    assert held_tokens(_signals(speed=0.0), 32) == 1500
    assert held_tokens(_signals(), None) == 1500


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 600), st.integers(1, 300), st.integers(0, 300)), min_size=1, max_size=6),
    st.lists(st.tuples(st.integers(1, 600), st.integers(1, 300)), max_size=3),
    st.integers(1, 600), st.integers(1, 300),
)
def test_admitted_requests_never_push_the_batch_past_capacity(
    others: list[tuple[int, int, int]], picked: list[tuple[int, int]], prompt: int, output: int
) -> None:
    """Simulate continuous batching one token per step: whenever the rule admits the new request
    next to sequences (prompt, limit, produced so far) in the sample and requests picked since it
    (prompt, limit: not in the sample's KV, starting now), their KV never exceeds the capacity
    before the new one finishes (after that it holds nothing)."""
    seqs = [(p, m, min(done, m - 1)) for p, m, done in others] + [(p, m, 0) for p, m in picked]
    held_now = sum(p + done for p, _, done in seqs[:len(others)])
    committed = sum(p + m for p, m, _ in seqs)
    if held_now > CAPACITY:
        return
    s = _signals(running=len(others), kv=held_now / CAPACITY, committed=committed, waiting=len(picked),
                 new_tokens=sum(p + m for p, m in picked), new_outputs=sum(m for _, m in picked))
    if ROOM.over(s, cost=prompt + output, output=output):
        return
    for step in range(output + 1):
        total = prompt + step
        for p, m, done in seqs:
            if done + step < m:  # still running at this step
                total += p + done + step
        assert total <= CAPACITY
