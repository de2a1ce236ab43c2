"""Load counted in tokens: the ledger's committed tokens, capacity and speed from the page,
and saturation by room."""

from __future__ import annotations

import random

import pytest
from picking_helpers import MakePicker, Pool, endpoints, observe

from modeldock.clock import FakeClock
from modeldock.errors import RateLimited
from modeldock.picking import Picker, Sample, Saturated, Saturation, parse_metrics
from modeldock.picking.headroom import KvHeadroom
from modeldock.picking.wait import PredictedWait
from tests.support.vllm_page import vllm_metrics_page

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _capacity(picker: Picker, clock: FakeClock, ep: object, capacity: float, **kw: float) -> None:
    picker.observe(ep, Sample(kw.get("waiting", 0.0), kw.get("running", 0.0), kw.get("kv", 0.0),  # type: ignore[arg-type]
                              capacity=capacity), clock.monotonic())


def test_output_limits_known_follow_each_request_sorted_through_move_and_release(make_picker: MakePicker) -> None:
    # Signals.ends: (output limit, committed) of the requests there that said their limit, shortest first.
    picker = make_picker(fallbacks=1)
    a, b = endpoints(2)
    picker.set_endpoints("m", [a])
    long = picker.pick("m", cost=600, output=256)
    short = picker.pick("m", cost=300, output=32)
    unsaid = picker.pick("m", cost=400)
    assert list(picker.signals(a).ends) == [(32, 300), (256, 600)]
    picker.set_endpoints("m", [a, b])
    assert long.lease.move_to(b.address)
    assert list(picker.signals(a).ends) == [(32, 300)] and list(picker.signals(b).ends) == [(256, 600)]
    short.lease.release()
    unsaid.lease.release()
    long.lease.release()
    assert not picker.signals(a).ends and not picker.signals(b).ends


def test_claim_move_and_release_carry_tokens_exactly_once(pool: Pool) -> None:
    picker, (a, b) = pool(2, fallbacks=1)
    first = picker.pick("m", cost=300)
    second = picker.pick("m", cost=50)
    assert picker.total_committed() == 350
    assert {picker.committed(a), picker.committed(b)} == {300, 50}
    other = b if first.primary == a else a
    assert first.lease.move_to(other.address)
    assert picker.committed(first.primary) == 0 and picker.committed(other) == 350
    assert not first.lease.move_to(other.address)  # already there: nothing moves
    first.lease.release()
    first.lease.release()  # idempotent
    assert picker.total_committed() == 50 and picker.committed(other) == 50
    second.lease.release()
    assert picker.total_committed() == 0 and picker.total_in_flight() == 0


def test_tokens_sent_since_the_sample_are_new_until_the_next_one(pool: Pool, clock: FakeClock) -> None:
    picker, (a, b) = pool(2)
    observe(picker, clock, a)
    p1 = picker.pick("m", cost=100)
    assert picker.signals(a).new_tokens == 100 and picker.signals(a).committed == 100
    observe(picker, clock, a, running=1)  # the page now reflects p1
    assert picker.signals(a).new_tokens == 0 and picker.signals(a).committed == 100
    p2 = picker.pick("m", cost=40, output=30)  # 10 of prompt, 30 of output limit
    assert (picker.signals(a).new_tokens, picker.signals(a).new_outputs) == (40, 30)
    # A page that arrived when only p1 was in flight: p2 is still new.
    picker.observe(a, Sample(0, 1, 0.0), clock.monotonic(), in_flight_at=1)
    assert (picker.signals(a).new_tokens, picker.signals(a).new_outputs) == (40, 30)
    p2.lease.move_to(b.address)  # a retry went elsewhere: its output limit goes along
    assert (picker.signals(b).new_tokens, picker.signals(b).new_outputs) == (40, 30)
    assert (picker.signals(a).new_tokens, picker.signals(a).new_outputs) == (0, 0)
    observe(picker, clock, b, running=1)  # b's page reflects it: nothing is new there any more
    assert picker.signals(b).new_outputs == 0
    p1.lease.release()
    p2.lease.release()
    assert picker.signals(a).committed == 0 and picker.signals(a).new_tokens == 0
    assert picker.signals(b).committed == 0 and picker.signals(b).new_outputs == 0


def test_parser_reads_capacity_only_when_asked_and_the_token_counters() -> None:
    page = vllm_metrics_page(MODEL, waiting=(1,), running=(2,), kv=(0.5,))
    plain = parse_metrics(page, MODEL)
    with_capacity = parse_metrics(page, MODEL, capacity=True)
    assert plain is not None and with_capacity is not None
    assert plain.capacity is None
    assert with_capacity.capacity == 27000 * 16 and with_capacity.block_size == 16 and plain.block_size is None
    assert plain.tokens_total is not None and plain.tokens_total > 0
    assert (plain.waiting, plain.running, plain.kv) == (with_capacity.waiting, with_capacity.running, 0.5)


def test_parser_sums_engines_and_ignores_an_unprofiled_cache() -> None:
    page = ('vllm:num_requests_waiting{engine="0",model_name="m"} 0\n'
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0\n'
            'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="50"} 1.0\n'
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 10\n'
            'vllm:generation_tokens_total{engine="0",model_name="m"} 5\n'
            'vllm:generation_tokens_total{engine="0",model_name="other"} 500\n')
    sample = parse_metrics(page, "m", capacity=True)
    assert sample is not None and sample.capacity == 150 * 16 and sample.tokens_total == 15
    unprofiled = 'vllm:num_requests_waiting 0\nvllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    sample = parse_metrics(unprofiled, "m", capacity=True)
    assert sample is not None and sample.capacity is None


def test_speed_is_learned_from_counters_while_busy(pool: Pool, clock: FakeClock) -> None:
    picker, (a, b) = pool(2)
    for ep, per_second in ((a, 1000.0), (b, 250.0)):
        total = 0.0
        for _ in range(4):
            picker.observe(ep, Sample(0, 3, 0.2, tokens_total=total), clock.monotonic())
            total += per_second * 0.5
            clock.advance(0.5)
    assert picker.signals(a).speed == pytest.approx(1000.0)
    assert picker.signals(b).speed == pytest.approx(250.0)
    # Idle intervals teach nothing; a counter that goes backwards (restart) starts over.
    picker.observe(a, Sample(0, 0, 0.0, tokens_total=1500.0), clock.monotonic())
    clock.advance(5.0)
    picker.observe(a, Sample(0, 0, 0.0, tokens_total=1510.0), clock.monotonic())  # idle both ends
    clock.advance(0.5)
    picker.observe(a, Sample(0, 2, 0.0, tokens_total=5.0), clock.monotonic())
    assert picker.signals(a).speed == pytest.approx(1000.0)
    # The slower one predicts a longer wait for the same committed work.
    wait = PredictedWait()
    sa = picker.signals(a)._replace(committed=4000, in_flight=2)
    sb = picker.signals(b)._replace(committed=4000, in_flight=2)
    assert wait(sb) > wait(sa) > 0


def test_kv_headroom_counts_committed_and_used(make_picker: MakePicker, clock: FakeClock) -> None:
    scorer = KvHeadroom()
    picker = make_picker()
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    assert scorer(picker.signals(a)) == 0.0
    _capacity(picker, clock, a, 1000, kv=0.2)
    assert scorer(picker.signals(a)) == pytest.approx(0.2)
    lease = picker.pick("m", cost=500).lease
    assert scorer(picker.signals(a)) == pytest.approx(0.7)  # used 200 + 500 sent since
    lease.release()


def test_room_saturation_by_committed_tokens(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(saturation=Saturation(room=True))
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    _capacity(picker, clock, a, 1000)
    big = picker.pick("m", cost=1500)  # nothing in flight: an idle endpoint takes any request
    with pytest.raises(Saturated) as caught:
        picker.pick("m", cost=1)
    assert isinstance(caught.value, RateLimited) and caught.value.code == "endpoints_saturated"
    big.lease.release()
    first = picker.pick("m", cost=600)
    with pytest.raises(Saturated):
        picker.pick("m", cost=401)
    second = picker.pick("m", cost=400)  # exactly fits
    assert picker.committed(a) == 1000
    clock.advance(10)  # stale: the local tokens still say full
    with pytest.raises(Saturated):
        picker.pick("m", cost=1)
    first.lease.release()
    second.lease.release()


def test_a_paged_cache_keeps_a_part_empty_block_per_sequence(make_picker: MakePicker, clock: FakeClock) -> None:
    # 1,000 tokens in blocks of 16: each sequence there may hold up to 15 more than its tokens,
    # the new one too, so two requests fit in 1,000 - 2 x 15 tokens, not 1,000.
    picker = make_picker(saturation=Saturation(room=True))
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    picker.observe(a, Sample(0, 0, 0.0, capacity=1000, block_size=16), clock.monotonic())
    first = picker.pick("m", cost=600)
    with pytest.raises(Saturated):
        picker.pick("m", cost=371)
    second = picker.pick("m", cost=370)
    first.lease.release()
    second.lease.release()


def test_room_saturation_by_waiting_and_full_kv(pool: Pool, clock: FakeClock) -> None:
    picker, (full, busy) = pool(2, saturation=Saturation(room=True, kv_full=0.9), fallbacks=1)
    observe(picker, clock, full, waiting=1, kv=0.95)
    observe(picker, clock, busy, waiting=0, running=60, kv=0.97)  # KV full of long generations, no queue
    pick = picker.pick("m")
    assert pick.primary == busy  # not saturated: vLLM is still admitting
    # The pick just sent counts as waiting there now: both are full.
    with pytest.raises(Saturated):
        picker.pick("m")
    pick.lease.release()


def test_room_saturation_when_stale_uses_a_bound_on_in_flight(make_picker: MakePicker, clock: FakeClock) -> None:
    picker = make_picker(saturation=Saturation(room=True, stale_max_in_flight=2))
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    leases = [picker.pick("m").lease for _ in range(2)]
    with pytest.raises(Saturated):
        picker.pick("m")
    observe(picker, clock, a, running=2)  # fresh and not full: the bound does not apply
    leases.append(picker.pick("m").lease)
    for lease in leases:
        lease.release()


def test_room_listeners_hear_release_move_and_samples(pool: Pool, clock: FakeClock) -> None:
    picker, (a, b) = pool(2, fallbacks=1)
    picker.set_endpoints("n", [b])
    heard: list[str] = []
    picker.add_room_listener(heard.append)
    pick = picker.pick("m")
    assert heard == []
    pick.lease.move_to((b if pick.primary == a else a).address)
    pick.lease.release()
    assert heard == ["m", "m"]
    heard.clear()
    observe(picker, clock, b)
    assert sorted(heard) == ["m", "n"]


def test_release_listeners_hear_the_endpoint_a_request_left(pool: Pool) -> None:
    picker, (a, b) = pool(2, fallbacks=1)
    left: list[object] = []
    picker.add_release_listener(left.append)
    pick = picker.pick("m")
    first = pick.primary
    other = b if first == a else a
    assert left == []
    assert pick.lease.move_to(other.address)  # a retry served it elsewhere: it left `first`
    assert left == [first]
    pick.lease.release()
    pick.lease.release()  # once
    assert left == [first, other]


def test_random_claims_and_releases_keep_tokens_exact() -> None:
    clock = FakeClock()
    picker = Picker(clock, fallbacks=2, rng=random.Random(5))
    eps = endpoints(4)
    picker.set_endpoints("m", eps)
    rng = random.Random(11)
    held = []
    for _ in range(500):
        if held and rng.random() < 0.45:
            lease, _cost = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.3:
                lease.move_to(rng.choice(eps).address)
            lease.release()
        else:
            cost = rng.randint(1, 5000)
            held.append((picker.pick("m", cost=cost).lease, cost))
        if rng.random() < 0.1:
            observe(picker, clock, rng.choice(eps), running=rng.randint(0, 5))
        assert picker.total_committed() == sum(c for _, c in held)
        for ep in eps:
            assert picker.committed(ep) == sum(c for lease, c in held if lease.endpoint == ep)
    for lease, _ in held:
        lease.release()
    assert picker.total_committed() == 0
