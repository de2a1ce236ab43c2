"""`Signals` is built by keyword, in four groups, and its fast builder keeps the declared order."""

from __future__ import annotations

import pytest

from modeldock.picking.signals import SIGNAL_GROUPS, Load, Sample, Signals


def test_signals_take_keywords_only() -> None:
    with pytest.raises(TypeError):
        Signals(True, None)  # type: ignore[call-arg]


def test_every_keyword_lands_in_its_own_field() -> None:
    # A distinct value per field: a keyword wired to the wrong position shows as a mismatch.
    values: dict[str, object] = {name: f"v{i}" for i, name in enumerate(Signals._fields)}
    s = Signals(**values)  # type: ignore[arg-type]
    assert {name: getattr(s, name) for name in Signals._fields} == values


def test_the_groups_cover_every_field_once() -> None:
    grouped = [name for names in SIGNAL_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(Signals._fields) and len(grouped) == len(set(grouped))
    assert list(SIGNAL_GROUPS) == ["sample", "counts", "progress", "rates"]


def test_the_ledger_builds_the_fields_it_means() -> None:
    load = Load()
    load.sample, load.taken_at = Sample(waiting=3.0, running=2.0, kv=0.25), 10.0
    load.capacity, load.block, load.speed, load.growth, load.limit = 4096.0, 16, 900.0, 300.0, 6.0
    load.add(1, tokens=700, output=200)
    load.steps, load.freed = 5.0, 40.0
    s = load.signals(now=10.5, stale_after=2.0)
    assert (s.fresh, s.sample, s.kv, s.age, s.freed) == (True, load.sample, 0.25, 0.5, 40.0)
    assert (s.waiting, s.running, s.backlog, s.gone_tokens) == (4.0, 2.0, 3.0, 0)  # the pick since: queued
    assert (s.in_flight, s.committed, s.new_tokens, s.new_outputs) == (1, 700, 700, 200)
    assert (s.steps, list(s.ends)) == (5.0, [(200.0, 700)])  # due at step 0 + its output limit
    assert (s.capacity, s.block, s.speed, s.growth, s.limit) == (4096.0, 16, 900.0, 300.0, 6.0)
    stale = load.signals(now=13.0, stale_after=2.0)
    assert (stale.fresh, stale.waiting, stale.running, stale.kv, stale.age, stale.freed) == (False, 0, 0, 0, 0, 0)
    assert (stale.in_flight, stale.committed, stale.capacity, stale.limit) == (1, 700, 4096.0, 6.0)
