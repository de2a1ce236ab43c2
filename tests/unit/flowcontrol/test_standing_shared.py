"""Standing across replicas: share() / apply_peers() make every replica answer as one would."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from modeldock.clock import FakeClock
from modeldock.flowcontrol.standing import Standing
from modeldock.flowcontrol.standing_share import ModelStanding

WEIGHTS = {"a": 1.0, "b": 2.0, "c": 1.0}


def _exchange(replicas: Sequence[Standing]) -> None:
    """What the transport does: every replica gets every other's latest share."""
    shares = [r.share() for r in replicas]
    for i, r in enumerate(replicas):
        r.apply_peers([s for j, s in enumerate(shares) if j != i])


def _flood(one: Standing, two: Standing, clock: FakeClock, exchange: bool) -> None:
    """A sends 3000 tokens a second through replica 1, B 500 through replica 2, for 10 s."""
    for _ in range(40):
        one.seen("m", "A", 1.0, 1)
        one.served("m", "A", 750, 1.0)
        two.seen("m", "B", 1.0, 1)
        two.served("m", "B", 125, 1.0)
        if exchange:
            _exchange([one, two])
        clock.advance(0.25)


def test_a_tenant_flooding_one_replica_leaves_headroom_for_one_arriving_through_another() -> None:
    clock = FakeClock()
    one, two = Standing(clock, 2.0, 10.0), Standing(clock, 2.0, 10.0)
    _flood(one, two, clock, exchange=True)
    assert one.must_leave_headroom("m", "A", 1.0, 1)
    assert not two.must_leave_headroom("m", "B", 1.0, 1)
    assert one.active_weight("m") == two.active_weight("m") == 2.0
    assert one.contended("m", "A", 1) and two.contended("m", "B", 1)
    # A's served tokens are one and the same on both replicas.
    assert abs(one.served_tokens("m", "A") - two.served_tokens("m", "A")) < 1e-6 * one.served_tokens("m", "A")


def test_without_the_exchange_each_replica_thinks_its_tenant_alone() -> None:
    clock = FakeClock()
    one, two = Standing(clock, 2.0, 10.0), Standing(clock, 2.0, 10.0)
    _flood(one, two, clock, exchange=False)
    assert not one.must_leave_headroom("m", "A", 1.0, 1)  # its whole share: the room kept for B is A's
    assert not one.contended("m", "A", 1)
    assert one.active_weight("m") == 1.0


def test_a_higher_class_seen_on_a_peer_makes_a_lower_class_leave_headroom_here() -> None:
    clock = FakeClock()
    one, two = Standing(clock, 2.0), Standing(clock, 2.0)
    one.seen("m", "ivy", 1.0, 2)
    two.seen("m", "bat", 1.0, 0)
    assert not two.must_leave_headroom("m", "bat", 1.0, 0)
    _exchange([one, two])
    assert two.must_leave_headroom("m", "bat", 1.0, 0)
    assert two.contended("m", "bat", 0)  # ivy, another tenant, is on the model
    assert one.contended("m", "ivy", 2)  # bat's lower class is kept from the room
    clock.advance(1.0)
    _exchange([one, two])
    clock.advance(1.0)  # two seconds after ivy's request, on replica 2's clock, without a new exchange
    assert not two.must_leave_headroom("m", "bat", 1.0, 0)


def test_forgetting_the_peers_returns_to_the_local_answer_and_shares_never_echo() -> None:
    clock = FakeClock()
    one, two = Standing(clock, 2.0, 10.0), Standing(clock, 2.0, 10.0)
    _flood(one, two, clock, exchange=True)
    local = msgspec.json.encode(two.share())
    two.apply_peers([one.share()])
    assert msgspec.json.encode(two.share()) == local  # only what replica 2 saw itself
    assert [t.tenant for ms in two.share() for t in ms.tenants] == ["B"]
    one.apply_peers([])
    assert not one.must_leave_headroom("m", "A", 1.0, 1)
    assert one.active_weight("m") == 1.0
    assert one.served_tokens("m", "B") == 0.0


def test_a_peers_served_tokens_decay_on_here() -> None:
    clock = FakeClock()
    one, two = Standing(clock, 100.0, 10.0), Standing(clock, 100.0, 10.0)
    one.seen("m", "A", 1.0, 1)
    one.served("m", "A", 1000, 1.0)
    _exchange([one, two])
    assert two.served_tokens("m", "A") == 1000.0
    clock.advance(10.0)
    assert abs(two.served_tokens("m", "A") - 367.879) < 0.01  # e^-1 of it, one time constant on
    assert two.kept_tokens("m") is None
    one.protected("m", 640)
    _exchange([one, two])
    assert two.kept_tokens("m") == 640


def test_a_share_survives_the_wire() -> None:
    clock = FakeClock()
    one = Standing(clock, 2.0)
    one.seen("m", "A", 1.5, 2)
    one.served("m", "A", 10, 1.5)
    one.protected("m", 99)
    wire = msgspec.msgpack.encode(one.share())
    assert msgspec.msgpack.decode(wire, type=tuple[ModelStanding, ...]) == one.share()


_event = st.one_of(
    st.tuples(st.just("seen"), st.sampled_from(sorted(WEIGHTS)), st.integers(0, 2), st.integers(0, 2)),
    st.tuples(st.just("served"), st.sampled_from(sorted(WEIGHTS)), st.integers(1, 900), st.integers(0, 2)),
    st.tuples(st.just("protected"), st.just(""), st.integers(1, 900), st.integers(0, 2)),
    st.tuples(st.just("advance"), st.just(""), st.integers(1, 12), st.just(0)),
)


def _run(events: list[tuple[str, str, int, int]], k: int, pinned: dict[str, int] | None) -> None:
    """Every event also goes to ONE Standing; after each, every replica answers as it does.
    `pinned`: each tenant's requests all arrive through one replica (else the event says which)."""
    clock = FakeClock()
    alone = Standing(clock, 2.0, 8.0)
    replicas = [Standing(clock, 2.0, 8.0) for _ in range(k)]
    until: dict[str, float] = {}  # each tenant's window, as the test sees it
    rejoined = False  # a tenant came back after its window: the start-at-share artefact may begin
    for kind, tenant, n, where in events:
        now = clock.monotonic()
        if kind == "advance":
            clock.advance(n * 0.25)
        else:
            r = replicas[(pinned[tenant] if pinned is not None and tenant else where) % k]
            if tenant and tenant in until and until[tenant] <= now:
                rejoined = True
            if kind == "seen":
                for s in (alone, r):
                    s.seen("m", tenant, WEIGHTS[tenant], n)
                until[tenant] = now + 2.0
            elif kind == "served":
                for s in (alone, r):
                    s.served("m", tenant, n, WEIGHTS[tenant])
                if until.get(tenant, -1.0) <= now:
                    until[tenant] = now + 2.0
            else:
                for s in (alone, r):
                    s.protected("m", n)
            _exchange(replicas)
        for one in replicas:
            assert one.active_weight("m") == alone.active_weight("m")
            assert one.kept_tokens("m") == alone.kept_tokens("m")
            for tenant in WEIGHTS:
                for priority in range(3):
                    assert one.contended("m", tenant, priority) == alone.contended("m", tenant, priority)
                    if pinned is not None or not rejoined:
                        assert one.must_leave_headroom("m", tenant, WEIGHTS[tenant], priority) == \
                            alone.must_leave_headroom("m", tenant, WEIGHTS[tenant], priority), (tenant, priority)


@settings(max_examples=300, deadline=None)
@given(st.lists(_event, max_size=30), st.integers(2, 3), st.lists(st.integers(0, 2), min_size=3, max_size=3))
def test_replicas_each_with_its_tenants_answer_as_one_standing_that_saw_everything(
        events: list[tuple[str, str, int, int]], k: int, homes: list[int]) -> None:
    _run(events, k, dict(zip(sorted(WEIGHTS), homes, strict=True)))


@settings(max_examples=300, deadline=None)
@given(st.lists(_event, max_size=30), st.integers(2, 3))
def test_replicas_sharing_tenants_answer_as_one_standing_until_a_tenant_comes_back(
        events: list[tuple[str, str, int, int]], k: int) -> None:
    _run(events, k, None)
