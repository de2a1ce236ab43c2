"""One replica reads each endpoint's page and relays it (sharing/split.py, picking/relay.py): who owns
what, what a relayed page means to the receiving replica, and scrapers that split real pages."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from modeldock.clock import FakeClock
from modeldock.config import parse_config
from modeldock.extproc.app import _split_scraping
from modeldock.picking import Picker, Sample, Scraper
from modeldock.sharing.config import SharingConfig
from modeldock.sharing.records import ReplicaShare, decode
from modeldock.sharing.split import ScrapeSplit
from modeldock.sharing.sync import Sharing
from modeldock.types import Endpoint
from tests.support.share_store import ShareHub
from tests.support.vllm_page import vllm_metrics_page

pytestmark = pytest.mark.timeout(30)

EP = Endpoint("10.0.0.1", 8000)
CONFIG = SharingConfig(interval_ms=100, ttl_ms=2000, timeout_ms=100)
MODEL = "/models/meta-llama/Llama-3.3-70B-Instruct"
ADDRESSES = [f"10.1.{i // 250}.{i % 250}:8000" for i in range(1000)]


# -- who reads what -------------------------------------------------------


def test_every_replica_computes_the_same_single_owner_for_each_endpoint() -> None:
    names = ["gw-a", "gw-b", "gw-c"]
    splits = [ScrapeSplit(name) for name in names]
    for split in splits:
        split.set_peers(n for n in names if n != split.replica)
    for address in ADDRESSES:
        owners = [s.replica for s in splits if s.owns(address)]
        assert len(owners) == 1
        assert all(s.owner(address) == owners[0] for s in splits)
    counts = {name: sum(ScrapeSplit(name).owner(a) == name for a in ADDRESSES) for name in names}
    shares = {name: sum(s.owns(a) for a in ADDRESSES) for name, s in zip(names, splits, strict=True)}
    assert all(250 <= n <= 420 for n in shares.values()), shares  # about a third each
    assert counts == {n: 1000 for n in names}  # alone, a replica owns everything


def test_a_replica_joining_takes_only_the_endpoints_it_wins() -> None:
    a = ScrapeSplit("gw-a")
    a.set_peers(["gw-b"])
    before = {addr: a.owner(addr) for addr in ADDRESSES}
    a.set_peers(["gw-b", "gw-c"])
    after = {addr: a.owner(addr) for addr in ADDRESSES}
    moved = [addr for addr in ADDRESSES if before[addr] != after[addr]]
    assert moved and all(after[addr] == "gw-c" for addr in moved)  # nothing moves between a and b
    assert 250 <= len(moved) <= 420
    a.set_peers([])
    assert all(a.owns(addr) for addr in ADDRESSES)  # on its own (no shared view): every endpoint


# -- what a relayed page means here ---------------------------------------


class Replica:
    def __init__(self, name: str, hub: ShareHub, endpoints: list[Endpoint] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.picker = Picker(hub.clock, fallbacks=0, rng=random.Random(1))
        self.picker.set_endpoints("m", endpoints or [EP], served_name=MODEL)
        self.sharing = Sharing(self.picker, hub.store(), hub.clock, CONFIG, self.registry, replica=name,
                               pages=self.picker)

    def metric(self, name: str) -> float:
        return self.registry.get_sample_value(name) or 0.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def hub(clock: FakeClock) -> ShareHub:
    return ShareHub(clock)


async def test_a_relayed_page_is_a_fresh_sample_here_with_its_age_and_the_readers_capacity(
        hub: ShareHub, clock: FakeClock) -> None:
    a, b = Replica("a", hub), Replica("b", hub)
    assert not b.picker.signals(EP).fresh
    a.picker.observe(EP, Sample(waiting=2, running=5, kv=0.4, capacity=8000, block_size=16, tokens_total=100,
                                generated_total=40), clock.monotonic())
    clock.advance(0.3)
    await a.sharing.exchange()
    await b.sharing.exchange()
    s = b.picker.signals(EP)
    assert s.fresh and (s.sample is not None and s.sample.waiting, s.sample.running, s.kv) == (2, 5, 0.4)
    assert (s.capacity, s.block) == (8000, 16)
    assert b.picker.sample_age(EP) == pytest.approx(0.3)  # read 0.3 s ago, on b's clock
    assert b.metric("modeldock_sharing_pages_total") == 1
    # The same page in a's next share changes nothing here; b's own pages are not sent back as a's.
    await a.sharing.exchange()
    await b.sharing.exchange()
    assert b.metric("modeldock_sharing_pages_total") == 1
    assert b.picker.pages() == ()
    await a.sharing.exchange()
    assert a.metric("modeldock_sharing_pages_total") == 0


async def test_a_relayed_page_shows_this_replicas_requests_picked_before_it_and_not_those_after(
        hub: ShareHub, clock: FakeClock) -> None:
    a, b = Replica("a", hub), Replica("b", hub)
    b.picker.pick("m", cost=100, output=10)
    clock.advance(0.2)
    a.picker.observe(EP, Sample(waiting=0, running=1, kv=0.1), clock.monotonic())  # shows b's request
    clock.advance(0.1)
    b.picker.pick("m", cost=300, output=30)  # after a's page: not in it
    await a.sharing.exchange()
    await b.sharing.exchange()
    s = b.picker.signals(EP)
    assert (s.in_flight, s.new_tokens, s.new_outputs) == (2, 300, 30)


async def test_an_older_relayed_page_never_replaces_a_newer_own_read(hub: ShareHub, clock: FakeClock) -> None:
    a, b = Replica("a", hub), Replica("b", hub)
    a.picker.observe(EP, Sample(waiting=0, running=1, kv=0.1), clock.monotonic())
    clock.advance(0.2)
    b.picker.observe(EP, Sample(waiting=0, running=7, kv=0.7), clock.monotonic())
    await a.sharing.exchange()
    await b.sharing.exchange()
    sample = b.picker.signals(EP).sample
    assert sample is not None and sample.running == 7


# -- scrapers that split the pages ----------------------------------------


@pytest.fixture
async def servers() -> AsyncIterator[tuple[list[Endpoint], list[int]]]:
    counts = [0] * 6
    runners = []
    endpoints = []
    for i in range(len(counts)):
        async def metrics(request: web.Request, i: int = i) -> web.Response:
            counts[i] += 1
            return web.Response(text=vllm_metrics_page(MODEL, waiting=(float(i), 0.0), running=(1.0, 0.0)),
                                content_type="text/plain")
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        endpoints.append(Endpoint("127.0.0.1", runner.addresses[0][1]))
    yield endpoints, counts
    for runner in runners:
        await runner.cleanup()


async def test_two_replicas_read_each_page_once_and_both_hold_every_sample(
        hub: ShareHub, clock: FakeClock, servers: tuple[list[Endpoint], list[int]]) -> None:
    endpoints, counts = servers
    config = parse_config({"models": [{"name": "m", "endpoints": []}]})
    replicas = [Replica(name, hub, endpoints) for name in ("a", "b")]
    scrapers = []
    for r in replicas:
        scraper = Scraper(r.picker, clock)
        _split_scraping(config, r.picker, scraper, r.sharing)
        scrapers.append(scraper)
    try:
        for r in (*replicas, replicas[0]):  # each has seen the other
            await r.sharing.exchange()
        # A replica with no sample of an endpoint yet reads it (a new replica is useful at once).
        for scraper in scrapers:
            await scraper.scrape_once()
        assert counts == [2] * len(endpoints)
        clock.advance(0.5)
        for r in (*replicas, replicas[0]):
            await r.sharing.exchange()
        for scraper in scrapers:
            await scraper.scrape_once()
        assert counts == [3] * len(endpoints), "from then on each page is read by exactly one replica"
        for r in (*replicas, replicas[0]):
            await r.sharing.exchange()
        for r in replicas:
            got = [r.picker.signals(ep).sample for ep in endpoints]
            assert all(s is not None for s in got)
            assert [s.waiting for s in got if s is not None] == [float(i) for i in range(len(endpoints))]
            assert all(r.picker.signals(ep).fresh for ep in endpoints)

        # b dies: within the TTL a's samples of b's endpoints age; past the late bound a reads them
        # itself, and once b is forgotten a owns them all.
        a, b = replicas
        owned_by_b = [ep for ep in endpoints if b.sharing.split.owns(ep.address)]
        assert owned_by_b and len(owned_by_b) < len(endpoints)
        clock.advance(2.5)
        await a.sharing.exchange()
        assert a.metric("modeldock_sharing_peers") == 0
        before = list(counts)
        await scrapers[0].scrape_once()
        assert [c - b0 for c, b0 in zip(counts, before, strict=True)] == [1] * len(endpoints)
    finally:
        for scraper in scrapers:
            await scraper.stop()


async def test_a_peer_that_relays_nothing_is_covered_once_its_pages_are_late(
        hub: ShareHub, clock: FakeClock, servers: tuple[list[Endpoint], list[int]]) -> None:
    endpoints, counts = servers
    config = parse_config({"models": [{"name": "m", "endpoints": []}]})
    a = Replica("a", hub, endpoints)
    silent = Sharing(Picker(clock), hub.store(), clock, CONFIG, replica="old-version")  # shares no pages
    scraper = Scraper(a.picker, clock)
    _split_scraping(config, a.picker, scraper, a.sharing)
    try:
        await silent.exchange()
        await a.sharing.exchange()
        await scraper.scrape_once()  # no samples yet: every page
        assert counts == [1] * len(endpoints)
        mine = [i for i, ep in enumerate(endpoints) if a.sharing.split.owns(ep.address)]
        assert 0 < len(mine) < len(endpoints)
        clock.advance(1.0)  # the peer's pages would be here by now; still within the late bound
        await silent.exchange()
        await a.sharing.exchange()
        await scraper.scrape_once()
        assert [i for i, c in enumerate(counts) if c == 2] == mine
        clock.advance(1.5)  # now late: a reads them itself, though the peer is alive
        await silent.exchange()
        await a.sharing.exchange()
        await scraper.scrape_once()
        assert [c - (2 if i in mine else 1) for i, c in enumerate(counts)] == [1] * len(endpoints)
    finally:
        await scraper.stop()


async def test_a_share_carries_the_reads_of_a_few_intervals_not_the_whole_pool(hub: ShareHub,
                                                                               clock: FakeClock) -> None:
    eps = [Endpoint("10.0.0.1", 8000 + i) for i in range(4)]
    a = Replica("a", hub, eps)
    for ep in eps[:2]:
        a.picker.observe(ep, Sample(waiting=0, running=1, kv=0.1), clock.monotonic())
    clock.advance(0.35)  # past 3 intervals of 0.1 s
    for ep in eps[2:]:
        a.picker.observe(ep, Sample(waiting=0, running=2, kv=0.2), clock.monotonic())
    a.picker.observe(eps[0], Sample(waiting=0, running=3, kv=0.3), clock.monotonic())  # read again: in
    await a.sharing.exchange()
    share = decode_share(hub, "a")
    assert sorted(p.address for p in share.pages) == sorted(ep.address for ep in (eps[0], *eps[2:]))
    assert [p.running for p in share.pages if p.address == eps[0].address] == [3]


def decode_share(hub: ShareHub, replica: str) -> ReplicaShare:
    return decode(hub.shares[replica][1])
