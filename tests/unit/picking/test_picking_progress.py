"""A request's progress from the pages: the engine steps an endpoint took between two pages (its
output token counter over the most requests there at once) are credited to the requests both
pages showed in its batch, and come off the steps they have left (`Signals.ends`)."""

from __future__ import annotations

from math import ceil

from picking_helpers import MakePicker, endpoints

from modeldock.clock import FakeClock
from modeldock.picking import Picker, Sample, saturation
from modeldock.picking.signals import Signals
from modeldock.types import Endpoint


def _left(s: Signals) -> list[int]:
    return [ceil(due - s.steps) for due, _ in s.ends]


def _one_endpoint(make_picker: MakePicker) -> tuple[Picker, Endpoint]:
    picker = make_picker()
    (a,) = endpoints(1)
    picker.set_endpoints("m", [a])
    return picker, a


def _page(picker: Picker, clock: FakeClock, ep: Endpoint, running: float, generated: float,
          waiting: float = 0.0, *, after: float = 0.5, out_of_turn: bool = False,
          capacity: float | None = None) -> None:
    clock.advance(after)
    picker.observe(ep, Sample(waiting, running, 0.3, capacity, tokens_total=generated, generated_total=generated),
                   clock.monotonic(), out_of_turn=out_of_turn)


def test_steps_count_only_for_requests_the_pages_showed_running(make_picker: MakePicker, clock: FakeClock) -> None:
    picker, a = _one_endpoint(make_picker)
    _page(picker, clock, a, running=0, generated=0)
    long = picker.pick("m", cost=600, output=256)
    assert _left(picker.signals(a)) == [256]
    _page(picker, clock, a, running=1, generated=0)  # shows it: its count starts here
    assert _left(picker.signals(a)) == [256]
    _page(picker, clock, a, running=1, generated=100)  # 100 tokens, one request: 100 steps
    assert _left(picker.signals(a)) == [156]
    short = picker.pick("m", cost=300, output=32)  # not on any page yet
    assert sorted(_left(picker.signals(a))) == [32, 156]
    _page(picker, clock, a, running=2, generated=200)  # 100 tokens over two requests: 50 steps
    assert sorted(_left(picker.signals(a))) == [32, 106]  # the short one's count starts only now
    # A page with requests waiting: one may have been preempted; nobody is credited, and every
    # count starts again at the next page with nothing waiting.
    _page(picker, clock, a, running=2, generated=260, waiting=1)
    assert sorted(_left(picker.signals(a))) == [32, 106]
    _page(picker, clock, a, running=2, generated=300)
    assert sorted(_left(picker.signals(a))) == [32, 106]
    _page(picker, clock, a, running=2, generated=340)
    assert sorted(_left(picker.signals(a))) == [12, 86]
    short.lease.release()
    long.lease.release()
    load = picker.load(a)
    assert not load.ends and not load.due and not load.running


def test_steps_are_counted_over_the_most_requests_there_between_pages(
    make_picker: MakePicker, clock: FakeClock,
) -> None:
    # Pages show one running at both ends, but three were in flight in between: 120 tokens are at
    # least 40 steps (a sequence gains at most one token per step), not 120.
    picker, a = _one_endpoint(make_picker)
    _page(picker, clock, a, running=0, generated=0)
    long = picker.pick("m", cost=600, output=256)
    _page(picker, clock, a, running=1, generated=0)
    burst = [picker.pick("m", cost=100, output=20) for _ in range(2)]
    for p in burst:
        p.lease.release()
    _page(picker, clock, a, running=1, generated=120)
    assert _left(picker.signals(a)) == [216]
    long.lease.release()


def test_a_request_picked_after_the_page_is_not_credited(make_picker: MakePicker, clock: FakeClock) -> None:
    picker, a = _one_endpoint(make_picker)
    _page(picker, clock, a, running=0, generated=0)
    first = picker.pick("m", cost=600, output=256)
    clock.advance(0.5)
    # A page taken while only `first` was in flight arrives after `second` was picked.
    second = picker.pick("m", cost=600, output=256)
    picker.observe(a, Sample(0, 1, 0.3, tokens_total=0, generated_total=0), clock.monotonic(), in_flight_at=1)
    _page(picker, clock, a, running=2, generated=100)
    assert sorted(_left(picker.signals(a))) == [206, 256]
    first.lease.release()
    second.lease.release()


def test_a_long_prompt_counts_the_steps_of_its_chunks(make_picker: MakePicker) -> None:
    picker, a = _one_endpoint(make_picker)
    picker.pick("m", cost=1300, output=100)  # 1,200 of prompt: up to three steps of prefill
    picker.pick("m", cost=612, output=100)  # 512: one, the step of its first token
    assert sorted(_left(picker.signals(a))) == [100, 102]


def test_pages_read_out_of_turn_count_steps_but_teach_no_rates_or_limit(
    make_picker: MakePicker, clock: FakeClock,
) -> None:
    picker, a = _one_endpoint(make_picker)
    _page(picker, clock, a, running=1, generated=0)
    long = picker.pick("m", cost=600, output=256)
    _page(picker, clock, a, running=1, generated=0)  # shows it
    _page(picker, clock, a, running=1, generated=100, after=0.01, out_of_turn=True)  # 10 ms later: 100 steps
    _page(picker, clock, a, running=1, generated=200, after=0.49)
    s = picker.signals(a)
    assert _left(s) == [56]  # steps from every page
    assert s.speed == 400.0  # 200 tokens over the round's 0.5 s, not 100 over 10 ms
    long.lease.release()
    # Requests waiting for a slot at a round page and at a page out of turn just after it: one
    # moment, not a queue that lasted; at two round pages in a row, the batch limit.
    _page(picker, clock, a, running=2, generated=200, waiting=1)
    _page(picker, clock, a, running=2, generated=200, waiting=1, after=0.01, out_of_turn=True)
    assert picker.signals(a).limit == 0
    _page(picker, clock, a, running=2, generated=200, waiting=1, after=0.49)
    assert picker.signals(a).limit == 2


# -- what a request that ended had held ------------------------------------------------------------


def test_an_ending_frees_what_the_page_showed_it_holding(make_picker: MakePicker, clock: FakeClock) -> None:
    # The page still counts an ended request's KV until the next one is read; what it held then is at
    # least its prompt and the output its counted steps credit it with (not its output limit: it may
    # have stopped short of it).
    picker, a = _one_endpoint(make_picker)
    _page(picker, clock, a, running=0, generated=0)
    first = picker.pick("m", cost=600, output=256)  # prompt 344
    second = picker.pick("m", cost=300, output=32)  # prompt 268
    _page(picker, clock, a, running=2, generated=0)
    _page(picker, clock, a, running=2, generated=200)  # 100 steps each
    assert picker.signals(a).freed == 0
    first.lease.release()
    assert picker.signals(a).freed == 344 + 100
    second.lease.release()  # its 32 are all credited (100 steps), no more
    assert picker.signals(a).freed == 344 + 100 + 268 + 32
    _page(picker, clock, a, running=0, generated=232)  # the page says it now
    assert picker.signals(a).freed == 0


def test_no_credit_for_what_the_page_did_not_show_in_the_batch(make_picker: MakePicker, clock: FakeClock) -> None:
    picker, a = _one_endpoint(make_picker)
    _page(picker, clock, a, running=0, generated=0)
    shown = picker.pick("m", cost=600, output=256)
    _page(picker, clock, a, running=1, generated=0)
    since = picker.pick("m", cost=300, output=32)  # picked after the page: not in its KV
    since.lease.release()
    assert picker.signals(a).freed == 0
    # A page with a request waiting: which of them is in the batch is not known.
    queued = picker.pick("m", cost=300, output=32)
    _page(picker, clock, a, running=1, generated=50, waiting=1)
    shown.lease.release()
    assert picker.signals(a).freed == 0
    # A page that shows fewer of them than were in flight: one may have ended before it was read,
    # its KV already out of the page.
    _page(picker, clock, a, running=1, generated=100)
    again = picker.pick("m", cost=400, output=64)
    _page(picker, clock, a, running=1, generated=150)  # two in flight, one shown
    queued.lease.release()
    assert picker.signals(a).freed == 0
    again.lease.release()


def test_what_the_ended_held_comes_off_the_kv_the_tokens_rule_reads(make_picker: MakePicker, clock: FakeClock) -> None:
    picker, a = _one_endpoint(make_picker)
    _page(picker, clock, a, running=0, generated=0)
    first = picker.pick("m", cost=600, output=256)
    _page(picker, clock, a, running=1, generated=0, capacity=2000)
    _page(picker, clock, a, running=1, generated=100)
    before = saturation._growing_now(picker.signals(a))
    first.lease.release()
    after = saturation._growing_now(picker.signals(a))
    assert before is not None and after is not None and before - after == 344 + 100


def test_an_ending_before_any_step_was_counted_frees_its_prompt(make_picker: MakePicker, clock: FakeClock) -> None:
    # A long prompt's chunks are steps without output: its steps left exceed its output limit.
    picker, a = _one_endpoint(make_picker)
    _page(picker, clock, a, running=0, generated=0)
    long_prompt = picker.pick("m", cost=1500, output=10)
    _page(picker, clock, a, running=1, generated=0)
    assert _left(picker.signals(a)) == [12]
    long_prompt.lease.release()
    assert picker.signals(a).freed == 1490
