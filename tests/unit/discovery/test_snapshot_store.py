"""SnapshotStore: single changes and batches, each one swap and one notification."""

from __future__ import annotations

from modeldock.clock import FakeClock
from modeldock.discovery.snapshot import Snapshot, SnapshotStore
from modeldock.types import Endpoint

A, B = Endpoint.parse("10.0.0.1:8000"), Endpoint.parse("10.0.0.2:8000")


def test_update_sorts_deduplicates_and_confirms() -> None:
    clock = FakeClock()
    store = SnapshotStore(clock)
    clock.advance(3.0)
    store.update("m", [B, A, B])
    assert store.current.endpoints("m") == (A, B)
    assert store.current.models["m"].confirmed_at == clock.monotonic()
    assert store.current.age("never", clock.monotonic()) == float("inf")


def test_a_batch_is_one_swap_and_one_notification() -> None:
    clock = FakeClock()
    store = SnapshotStore(clock)
    heard: list[Snapshot] = []
    store.subscribe(heard.append)
    store.update_many({f"m{i}": [A] for i in range(1000)})
    assert len(heard) == 1 and len(heard[0].models) == 1000
    clock.advance(5.0)
    store.update_many({"m0": [B]}, confirmed=[f"m{i}" for i in range(1, 1000)] + ["m0"])
    assert len(heard) == 2 and heard[1] is store.current
    assert store.current.endpoints("m0") == (B,), "a change in the same batch wins over its confirmation"
    assert all(store.current.age(f"m{i}", clock.monotonic()) == 0.0 for i in range(1000))
    assert store.current.endpoints("m7") == (A,)


def test_confirm_many_keeps_the_lists_and_an_empty_batch_changes_nothing() -> None:
    clock = FakeClock()
    store = SnapshotStore(clock)
    store.update_many({"a": [A], "b": [B]})
    heard: list[Snapshot] = []
    store.subscribe(heard.append)
    before = store.current
    clock.advance(2.0)
    store.confirm_many(["a", "b"])
    assert (store.current.endpoints("a"), store.current.endpoints("b")) == ((A,), (B,))
    assert store.current.age("a", clock.monotonic()) == 0.0 and before.age("a", clock.monotonic()) == 2.0
    store.confirm_many([])
    store.update_many({})
    assert len(heard) == 1, "nothing to change: no new snapshot, no rebuild"
