"""Adaptive scraping on an injected clock: real pages from local servers, time moved by the test.

The scraper's own loop is not running (but in the out-of-turn tests): each step advances the fake
clock and calls `scrape_due()`, exactly what one wake of the loop does, so nothing waits for time.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from modeldock.clock import FakeClock
from modeldock.config import ConfigError, parse_config
from modeldock.picking import Picker, Scraper
from modeldock.picking.config import RoutingConfig
from modeldock.types import Endpoint
from tests.support.page_server import PageServer, Site
from tests.support.scrape_sink import RecordingSink
from tests.support.vllm_page import vllm_metrics_page

pytestmark = pytest.mark.timeout(60)

MODEL = "/models/meta-llama/Llama-3.3-70B-Instruct"
ROUTING = RoutingConfig()  # interval 0.5 s, idle 1.25 s (derived), stale after 2 s
STEP = 0.05


@dataclass
class Rig:
    clock: FakeClock
    picker: Picker
    sink: RecordingSink
    scraper: Scraper
    sites: list[Site]
    registry: CollectorRegistry

    @property
    def eps(self) -> list[Endpoint]:
        return [site.endpoint for site in self.sites]

    async def run(self, seconds: float, check: Callable[[], None] | None = None) -> None:
        """Step the clock by STEP for `seconds`, one loop wake per step."""
        for _ in range(round(seconds / STEP)):
            self.clock.advance(STEP)
            await self.scraper.scrape_due()
            if check is not None:
                check()


MakeRig = Callable[..., "AsyncIterator[Rig]"]


@pytest.fixture
async def server() -> AsyncIterator[PageServer]:
    pages = PageServer()
    yield pages
    await pages.close()


async def _rig(server: PageServer, n: int = 6, queued: Callable[[], Iterable[str]] | None = None,
               routing: RoutingConfig = ROUTING) -> Rig:
    sites = await server.start(n, vllm_metrics_page(MODEL, waiting=(0.0,), running=(2.0,), kv=(0.1,)))
    clock = FakeClock()
    picker = Picker(clock, stale_after=routing.stale_after_seconds)
    picker.set_endpoints("m", [s.endpoint for s in sites], served_name=MODEL)
    sink = RecordingSink(picker)
    registry = CollectorRegistry()
    scraper = Scraper.from_config(sink, clock, routing, registry=registry, queued=queued)
    picker.add_claim_listener(scraper.hurry)
    picker.add_release_listener(scraper.refresh)
    return Rig(clock, picker, sink, scraper, sites, registry)


async def test_idle_endpoints_are_read_less_often_and_never_go_stale(server: PageServer) -> None:
    rig = await _rig(server)
    busy = rig.eps[0]
    lease = rig.picker.pick("m", subset=frozenset({busy})).lease
    bound = ROUTING.idle_interval + STEP  # the longest gap, plus one step of this stepped clock

    def fresh() -> None:
        for ep in rig.eps:
            signals = rig.picker.signals(ep)
            assert signals.fresh and signals.age <= bound, (ep, signals.age)

    try:
        await rig.scraper.scrape_due()  # the first read of everything
        await rig.run(30, fresh)
    finally:
        lease.release()
        await rig.scraper.stop()
    assert ROUTING.idle_interval == 1.25
    assert 30 / 0.5 <= rig.sink.reads[busy] <= 30 / 0.4 + 1  # every interval (reads due within the slack join early)
    for ep in rig.eps[1:]:
        assert 30 / 1.25 <= rig.sink.reads[ep] <= 30 / (1.25 - 0.1) + 2
    reads = {c: rig.registry.get_sample_value("modeldock_scrape_reads_total", {"cadence": c}) for c in ("busy", "idle")}
    assert reads["busy"] == rig.sink.reads[busy]
    assert reads["idle"] == sum(rig.sink.reads[ep] for ep in rig.eps[1:])


async def test_a_pick_puts_an_idle_endpoint_on_the_busy_cadence_at_once(server: PageServer) -> None:
    rig = await _rig(server, n=2)
    try:
        await rig.scraper.scrape_due()
        await rig.run(5)  # idle: about 1.25 s between reads
        ep = rig.eps[0]
        seen = rig.sink.reads[ep]
        for _ in range(40):  # on to just after one of its reads
            await rig.run(STEP)
            if rig.sink.reads[ep] > seen:
                break
        due = rig.scraper.due_at(ep)
        assert due is not None and due - rig.clock.monotonic() > 0.5  # not due within an interval...
        pick = rig.picker.pick("m", subset=frozenset({ep}))
        hurried = rig.scraper.due_at(ep)
        assert hurried is not None and hurried < due  # ...until a request is sent there
        before = rig.sink.reads[ep]
        await rig.run(0.5)
        assert rig.sink.reads[ep] == before + 1
        await rig.run(5)
        assert rig.sink.reads[ep] >= before + 10  # busy while the request runs: every interval
        pick.lease.release()
    finally:
        await rig.scraper.stop()


async def test_a_queue_for_the_model_puts_all_its_endpoints_on_the_busy_cadence(server: PageServer) -> None:
    queued: set[str] = set()
    rig = await _rig(server, n=3, queued=lambda: queued)
    try:
        await rig.scraper.scrape_due()
        await rig.run(10)
        idle = dict(rig.sink.reads)
        queued.add("m")  # requests wait for "m" (an endpoint full from elsewhere: nothing in flight here)
        await rig.run(10)
    finally:
        await rig.scraper.stop()
    for ep in rig.eps:
        assert idle[ep] <= 10 / 1.15 + 2
        assert rig.sink.reads[ep] - idle[ep] >= 10 / 0.5 - 1


async def test_a_failed_read_is_retried_at_the_busy_cadence(server: PageServer) -> None:
    rig = await _rig(server, n=1)
    dead = Endpoint("127.0.0.1", 1)  # nothing listens on port 1
    rig.picker.set_endpoints("m", [*rig.eps, dead], served_name=MODEL)
    try:
        await rig.scraper.scrape_due()
        await rig.run(10)
    finally:
        await rig.scraper.stop()
    assert rig.sink.failures[dead] >= 10 / 0.5  # retried every interval, not every idle interval
    assert rig.sink.reads[rig.eps[0]] <= 10 / 1.15 + 2


async def test_pages_are_read_over_one_kept_alive_connection_per_endpoint(server: PageServer) -> None:
    rig = await _rig(server, n=3)
    lease = rig.picker.pick("m", subset=frozenset({rig.eps[0]})).lease
    try:
        await rig.scraper.scrape_once()
        await rig.run(10)
        await rig.scraper.scrape_once()
    finally:
        lease.release()
        await rig.scraper.stop()
    for site in rig.sites:
        assert site.requests >= 10 and site.connections == 1


async def test_an_unchanged_page_is_not_read_again_where_the_server_says_so(server: PageServer) -> None:
    rig = await _rig(server, n=2)
    tagged, plain = rig.sites
    tagged.etag = True
    try:
        await rig.scraper.scrape_once()
        first = rig.picker.load(tagged.endpoint).taken_at
        rig.clock.advance(1.0)
        await rig.scraper.scrape_once()
        assert tagged.not_modified == 1 and plain.not_modified == 0
        assert rig.picker.load(tagged.endpoint).taken_at == first + 1.0  # the last page, applied anew
        again, read = rig.picker.signals(tagged.endpoint).sample, rig.picker.signals(plain.endpoint).sample
        assert again is not None and read is not None
        assert (again.waiting, again.running, again.kv) == (read.waiting, read.running, read.kv)
        tagged.page = vllm_metrics_page(MODEL, waiting=(5.0,), running=(2.0,), kv=(0.1,))
        rig.clock.advance(1.0)
        await rig.scraper.scrape_once()
        sample = rig.picker.signals(tagged.endpoint).sample
        assert sample is not None and sample.waiting == 5.0 and tagged.not_modified == 1
        assert rig.registry.get_sample_value("modeldock_scrape_unchanged_total") == 1
    finally:
        await rig.scraper.stop()


async def test_only_the_endpoints_this_process_scrapes_are_read(server: PageServer) -> None:
    sites = await server.start(4, vllm_metrics_page(MODEL))
    clock = FakeClock()
    picker = Picker(clock)
    picker.set_endpoints("m", [s.endpoint for s in sites], served_name=MODEL)
    mine = {sites[0].endpoint, sites[2].endpoint}
    scraper = Scraper(picker, clock, scrapes=lambda ep: ep in mine)
    try:
        result = await scraper.scrape_once()
    finally:
        await scraper.stop()
    assert set(result.samples) == mine
    assert [s.requests for s in sites] == [1, 0, 1, 0]


async def test_a_request_ending_reads_its_endpoint_out_of_turn(server: PageServer) -> None:
    rig = await _rig(server, n=2)
    ep, other = rig.eps
    rig.scraper.start()  # the loop reads everything once; the fake clock then never makes anything due
    try:
        await rig.sink.until(lambda: rig.sink.reads[ep] == 1 and rig.sink.reads[other] == 1)
        rig.clock.advance(0.1)  # past the refresh gap (0.05 s) since that read
        pick = rig.picker.pick("m", subset=frozenset({ep}))
        pick.lease.release()
        assert ep in rig.scraper.reading  # the ending scheduled a read at once
        await rig.sink.until(lambda: rig.sink.refreshed == [ep])
        again = rig.picker.pick("m", subset=frozenset({ep}))
        again.lease.release()  # within the gap of that read: none
        assert not rig.scraper.reading
        rig.clock.advance(0.1)
        rig.picker.pick("m", subset=frozenset({ep})).lease.release()
        await rig.sink.until(lambda: rig.sink.refreshed == [ep, ep])
        assert rig.sink.reads[other] == 1 and rig.sites[0].connections == 1
    finally:
        await rig.scraper.stop()
    rig.clock.advance(1.0)
    rig.picker.pick("m", subset=frozenset({ep})).lease.release()
    assert not rig.scraper.reading  # stopped: an ending reads nothing


def _config(scrape: dict[str, object], **routing: object) -> dict[str, object]:
    return {"models": [{"name": "m", "endpoints": ["10.0.0.1:8000"]}], "routing": {"scrape": scrape, **routing}}


def test_the_idle_interval_is_derived_from_the_stale_cutoff() -> None:
    assert parse_config(_config({})).routing.idle_interval == 1.25  # 2 s - 0.5 s timeout - 0.25 s margin
    assert parse_config(_config({}, stale_after_seconds=0.5)).routing.idle_interval == 0.5  # no room: off
    assert parse_config(_config({}, stale_after_seconds=30)).routing.idle_interval == 4.0  # capped
    assert parse_config(_config({"idle_interval_seconds": 0})).routing.idle_interval == 0.5  # off
    assert parse_config(_config({"idle_interval_seconds": 3}, stale_after_seconds=4)).routing.idle_interval == 3


def test_an_idle_interval_the_stale_cutoff_does_not_allow_is_an_error_naming_the_field() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(_config({"idle_interval_seconds": 1.5}), "gw.yaml")
    message = str(caught.value)
    assert message.startswith("gw.yaml: routing: scrape.idle_interval_seconds (1.5)")
    assert "stale_after_seconds (2)" in message


async def test_an_added_endpoint_is_read_at_the_next_wake_not_an_interval_later(server: PageServer) -> None:
    rig = await _rig(server, n=3)
    rig.picker.add_target_listener(rig.scraper.targets_changed)
    await rig.run(1.0)  # the targets were followed at the first wake, and every 0.5 s since
    added = rig.eps[2]
    rig.picker.set_endpoints("m", rig.eps[:2], served_name=MODEL)
    await rig.run(0.55)
    before = rig.sink.reads[added]
    rig.clock.advance(0.01)  # just after a re-read of the targets: the next is 0.5 s away
    await rig.scraper.scrape_due()
    rig.picker.set_endpoints("m", rig.eps, served_name=MODEL)  # discovery adds it back
    rig.clock.advance(0.01)
    await rig.scraper.scrape_due()
    assert rig.sink.reads[added] == before + 1  # its first read at the next wake
    assert rig.picker.signals(added).fresh
