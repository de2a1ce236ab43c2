"""The tokens rule with the output limit known: a short request joins long ones whose full limits
would not fit together, because none of them can grow by more than its own output while it runs;
a long request joins short ones, because they are done (and free their KV) before it has grown."""

from __future__ import annotations

from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from modeldock.picking.saturation import Saturation, fits_as_they_finish, held_tokens
from modeldock.picking.signals import Signals

ROOM = Saturation(room=True, kv_full=1.0)
CAPACITY = 1800.0


def _signals(*, running: float = 3, kv: float = 0.5, committed: int = 1500, fresh: bool = True,
             speed: float = 400.0, age: float = 0.0, new_tokens: int = 0, waiting: float = 0.0,
             new_outputs: int = 0, growth: float = 0.0, ends: tuple[tuple[float, int], ...] = (),
             capacity: float = CAPACITY, steps: float = 0.0, block: int = 0) -> Signals:
    return Signals(fresh=fresh, sample=None, waiting=waiting if fresh else 0.0, running=running if fresh else 0.0,
                   kv=kv if fresh else 0.0, age=age,
                   in_flight=int(running + waiting), committed=committed, new_tokens=new_tokens,
                   new_outputs=new_outputs, steps=steps, ends=ends,
                   capacity=capacity, block=block, speed=speed, growth=growth)


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


def test_what_was_produced_since_the_sample_counts_at_the_output_rate_when_known() -> None:
    # 1.2 s at 400 tokens/s (prompts and outputs) would be 480 tokens; at 50 output tokens/s, 60.
    assert ROOM.over(_signals(age=1.2), cost=400, output=32)
    assert not ROOM.over(_signals(age=1.2, growth=50.0), cost=400, output=32)


def test_a_long_request_joins_short_ones_that_are_done_before_it_has_grown() -> None:
    # Three sequences hold 900 now; two are short (limit 32, 400 committed each), one long (limit
    # 256, 700 committed). A long request of 600 (256 of output): 1500 + 600 > 1800 committed, and
    # 900 + 3 x 256 + 600 > 1800 growing; but after 32 steps the short ones are gone: at step 31 at
    # most 900 + 3 x 31 + 344 + 31 = 1368, at its last step 700 + 344 + 256 = 1300.
    s = _signals(ends=((32, 400), (32, 400), (256, 700)))
    assert held_tokens(s, 256) + 600 > CAPACITY
    assert fits_as_they_finish(s, 600, 256, CAPACITY)
    assert not ROOM.over(s, cost=600, output=256)
    # Without the limits (another gateway's sequences, or requests that did not say), it waits.
    assert ROOM.over(_signals(), cost=600, output=256)
    # The long one it would meet still counts: holding 1080 now, with 1300 committed, it does not
    # fit (at its last step min(1300, 1080 + 256) + 344 + 256 = 1900).
    s = _signals(kv=0.6, committed=2100, ends=((32, 400), (32, 400), (256, 1300)))
    assert ROOM.over(s, cost=600, output=256)
    assert not ROOM.over(s, cost=500, output=256)


def test_a_long_request_joins_long_ones_near_their_end() -> None:
    # Three long sequences (200 of prompt, limit 256) have run 128 steps each: 984 held, 1368
    # committed. Counted from their limits, a fourth (200 + 256) meets them all at its step 255
    # (1368 + 200 + 255 > 1800); with the 128 steps the pages showed, they are done at step 128:
    # at step 127 at most 984 + 3 x 127 + 200 + 127 = 1692, then only the new one.
    ends = ((256.0, 456),) * 3  # done by step 256 of the endpoint's count (at 0 now)
    fresh = _signals(kv=984 / CAPACITY, committed=1368, ends=ends)
    near = fresh._replace(steps=128.0)
    assert not fits_as_they_finish(fresh, 456, 256, CAPACITY)
    assert fits_as_they_finish(near, 456, 256, CAPACITY)
    assert ROOM.over(fresh, cost=456, output=256) and not ROOM.over(near, cost=456, output=256)
    # Ends already passed (the count says done; the release is on its way) hold their KV one step.
    done = _signals(kv=0.9, committed=1368, ends=ends, steps=500.0)
    assert fits_as_they_finish(done, 456, 256, CAPACITY)
    assert not fits_as_they_finish(done, 200 + 256 + 200, 256 + 200, CAPACITY - 600)


def test_finishing_is_not_counted_from_a_stale_sample() -> None:
    assert not fits_as_they_finish(_signals(fresh=False, ends=((32, 400),)), 600, 256, CAPACITY)


# A batch: sequences in the sample (prompt, limit, produced so far), requests picked since it
# (prompt, limit), the new request's prompt and output limit, which of the first nine said their
# output limit, the part of what each in the sample produced that the pages showed (the steps
# credited to it: at most what it produced), and the cache's block size (1: counted in tokens).
BATCH = (
    st.lists(st.tuples(st.integers(1, 600), st.integers(1, 300), st.integers(0, 300)), min_size=1, max_size=6),
    st.lists(st.tuples(st.integers(1, 600), st.integers(1, 300)), max_size=3),
    st.integers(1, 600), st.integers(1, 300), st.lists(st.booleans(), min_size=9, max_size=9),
    st.floats(0.0, 1.0), st.sampled_from([1, 16]),
)
STEPS = 1000.5  # the endpoint's step count: where the ends are counted from
Seq = tuple[int, int, int]


def _seqs(others: list[Seq], picked: list[tuple[int, int]]) -> list[Seq]:
    return [(p, m, min(done, m - 1)) for p, m, done in others] + [(p, m, 0) for p, m in picked]


def _paged(tokens: int, block: int) -> int:
    return -(-tokens // block) * block


def _peak(seqs: list[Seq], prompt: int, output: int, block: int = 1) -> int:
    """Continuous batching one token per step: the most KV the sequences and the new request hold
    together before the new one finishes (after that it holds nothing), in whole blocks."""
    return max(_paged(prompt + step, block) + sum(_paged(p + done + step, block) for p, m, done in seqs
                                                   if done + step < m)
               for step in range(output + 1))


def _batch_signals(seqs: list[Seq], others: int, picked: list[tuple[int, int]], said: list[bool],
                   capacity: float, credit: float, block: int, growth: float = 0.0) -> Signals | None:
    """The endpoint as the rule sees it (None when the sample's sequences alone exceed `capacity`)."""
    held_now = sum(_paged(p + done, block) for p, _, done in seqs[:others])
    if held_now > capacity:
        return None
    ends = tuple(sorted((STEPS + m - int(credit * done), p + m)
                        for (p, m, done), known in zip(seqs, said, strict=False) if known))
    return _signals(running=others, kv=held_now / capacity, committed=sum(p + m for p, m, _ in seqs),
                    waiting=len(picked), new_tokens=sum(p + m for p, m in picked),
                    new_outputs=sum(m for _, m in picked), growth=growth, capacity=capacity, ends=ends, steps=STEPS,
                    block=block if block > 1 else 0)


@settings(max_examples=400, deadline=None)
@given(*BATCH, st.floats(0.0, 300.0))
def test_admitted_requests_never_push_the_batch_past_capacity(
    others: list[Seq], picked: list[tuple[int, int]], prompt: int, output: int, said: list[bool], credit: float,
    block: int, growth: float,
) -> None:
    """Whenever the rule admits the new request next to sequences in the sample and requests
    picked since it (not in the sample's KV, starting now), their KV never exceeds the capacity
    before the new one finishes. Some of them said their output limit (`ends`: done within it, less
    the steps credited), the others did not."""
    seqs = _seqs(others, picked)
    s = _batch_signals(seqs, len(others), picked, said, CAPACITY, credit, block, growth)
    if s is None or ROOM.over(s, cost=prompt + output, output=output):
        return
    assert _peak(seqs, prompt, output, block) <= CAPACITY


@settings(max_examples=1000, deadline=None)
@given(*BATCH, st.integers(1, 40))
# The paged margin (block - 1 per sequence) uses the whole capacity up: no room, not "unknown".
@example(others=[(1, 1, 0)], picked=[], prompt=1, output=1, said=[False], credit=0.0, block=16, below=2)
def test_the_rule_refuses_just_below_the_batch_peak(
    others: list[Seq], picked: list[tuple[int, int]], prompt: int, output: int, said: list[bool], credit: float,
    block: int, below: int,
) -> None:
    """The same batches, with the capacity set a few tokens below the peak they would reach (the
    worst case, every sequence at its first step, is where a bound that is slightly off shows):
    the rule must refuse, whichever sequences said their limits and whatever part of their progress
    was credited."""
    seqs = _seqs(others, picked)
    s = _batch_signals(seqs, len(others), picked, said, float(_peak(seqs, prompt, output, block) - below), credit,
                       block)
    assume(s is not None)
    assert s is not None
    assert ROOM.over(s, cost=prompt + output, output=output)
