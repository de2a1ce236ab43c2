"""Prefix affinity across replicas: a prefix nobody has a record of goes to its home, the same endpoint
in every replica (rendezvous hashing of a hash that PYTHONHASHSEED does not salt), while load and the
replica's own table still decide when they have something to say."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

from modeldock.clock import FakeClock
from modeldock.picking import Picker, Sample
from modeldock.picking.affinity import PrefixAffinity
from modeldock.picking.prefix import prompt_blocks
from modeldock.picking.saturation import Saturation
from modeldock.picking.scorers import PickRequest
from modeldock.types import Endpoint

EPS = [Endpoint(f"10.3.0.{i + 1}", 8000) for i in range(5)]
SHARED = "system: answer from the attached document only. " * 50  # about 2,400 characters


def prompt(i: int) -> tuple[int, ...]:
    return prompt_blocks({"messages": [{"role": "system", "content": f"doc {i} " + SHARED},
                                       {"role": "user", "content": f"question {i}"}]})


def replica(seed: int, endpoints: list[Endpoint] = EPS, **kwargs: object) -> Picker:
    """One replica's picker, idle, with no history; its own RNG (replicas share no random state); the
    config's default prefix weight."""
    p = Picker(FakeClock(), prefix_weight=0.25, rng=random.Random(seed), **kwargs)  # type: ignore[arg-type]
    p.set_endpoints("m", endpoints)
    return p


def first_sends(p: Picker, prompts: range) -> list[Endpoint]:
    """Where `p` sends each of these (distinct) prefixes the first time it sees it."""
    out = []
    for i in prompts:
        pick = p.pick("m", prompt(i))
        out.append(pick.primary)
        pick.lease.release()
    return out


_CHILD = """
import json, random, sys
from modeldock.clock import FakeClock
from modeldock.picking import Picker
from modeldock.picking.prefix import prompt_blocks
from modeldock.types import Endpoint
p = Picker(FakeClock(), prefix_weight=0.25, rng=random.Random(int(sys.argv[1])))
p.set_endpoints("m", [Endpoint(f"10.3.0.{i + 1}", 8000) for i in range(5)])
blocks = prompt_blocks({"messages": [{"role": "system", "content": "doc 7 " + "system: answer. " * 50}]})
print(json.dumps([blocks[0], p.pick("m", blocks).primary.address]))
"""


def test_the_first_block_hash_and_the_home_are_the_same_under_different_hash_seeds() -> None:
    """Two processes, as two replicas: other hash seeds, other RNG seeds; the same hash and first send."""
    results = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _CHILD, seed], env=env, capture_output=True, text=True,
                             timeout=60, check=True)
        results.append(json.loads(out.stdout))
    assert results[0] == results[1]


def test_two_replicas_with_no_history_send_each_prefix_to_the_same_endpoint() -> None:
    one = first_sends(replica(1), range(40))
    two = first_sends(replica(2, list(reversed(EPS))), range(40))  # another RNG, another snapshot order
    assert one == two
    assert len(set(one)) == len(EPS)  # a home per prefix, not one endpoint for all


def test_a_big_pool_nominates_the_home_for_power_of_two_choices() -> None:
    many = [Endpoint(f"10.4.0.{i + 1}", 8000) for i in range(40)]
    one = first_sends(replica(3, many, p2c_threshold=8), range(20))
    two = first_sends(replica(4, many[::-1], p2c_threshold=8), range(20))
    assert one == two


def test_removing_an_endpoint_moves_only_the_prefixes_homed_there() -> None:
    before = first_sends(replica(1), range(100))
    gone = EPS[2]
    after = first_sends(replica(1, [ep for ep in EPS if ep != gone]), range(100))
    moved = [i for i in range(100) if before[i] != after[i]]
    assert moved == [i for i in range(100) if before[i] == gone]
    assert len(moved) >= 5  # the removed endpoint was home to its share


def test_a_light_load_on_the_home_does_not_move_a_first_send_but_a_queue_or_saturation_does() -> None:
    home = first_sends(replica(1), range(1))[0]
    light = replica(2)
    clock = FakeClock()
    for ep in EPS:
        light.observe(ep, Sample(waiting=0, running=1 if ep == home else 0, kv=0.1 if ep == home else 0.0),
                      clock.monotonic())
    assert first_sends(light, range(1)) == [home]
    queued = replica(2)
    for ep in EPS:
        queued.observe(ep, Sample(waiting=40 if ep == home else 0, running=64 if ep == home else 0,
                                  kv=0.95 if ep == home else 0.0), clock.monotonic())
    assert first_sends(queued, range(1)) != [home]
    full = replica(2, saturation=Saturation(room=True))
    full.set_endpoints("m", EPS, max_num_seqs=1)
    lease = full.pick("m", (), subset=frozenset({home})).lease  # the home's one slot is taken
    assert full.in_flight(home) == 1
    assert first_sends(full, range(1)) != [home]
    lease.release()


def test_with_history_the_replicas_own_table_decides() -> None:
    p = replica(1)
    home = first_sends(p, range(1))[0]
    other = next(ep for ep in EPS if ep != home)
    affinity = p.request_scorer("prefix")
    assert isinstance(affinity, PrefixAffinity)
    fresh = replica(5)
    fresh_affinity = fresh.request_scorer("prefix")
    assert isinstance(fresh_affinity, PrefixAffinity)
    fresh_affinity.picked(PickRequest("m", prompt(0)), other)  # this replica sent the prefix elsewhere once
    assert first_sends(fresh, range(1)) == [other]
    # Deeper blocks only: a prompt sharing just the first block still follows the table, not a home.
    assert fresh_affinity.nominate(PickRequest("m", prompt(0)[:1]), EPS) == [other]


def test_without_homing_a_prefix_with_no_record_gets_no_opinion() -> None:
    """The rule before homes, kept for benchmarks/affinity_replicas.py's side-by-side run."""
    affinity = PrefixAffinity(homing=False)
    request = PickRequest("m", prompt(0))
    assert affinity.score(request, EPS, []) is None and affinity.nominate(request, EPS) == []
    homing = PrefixAffinity()
    assert homing.nominate(request, EPS) == [homing.home(request.prefix_blocks, EPS)]


def test_homes_are_spread_evenly_over_the_endpoints() -> None:
    """Rendezvous hashing is only as fair as its weight: each endpoint homes about its share of prefixes."""
    many = [Endpoint(f"10.5.0.{i + 1}", 8000) for i in range(8)]
    affinity = PrefixAffinity()
    counts = dict.fromkeys(many, 0)
    for i in range(4000):
        home = affinity.home(prompt(i), many)
        assert home is not None
        counts[home] += 1
    assert all(400 <= c <= 600 for c in counts.values()), counts  # 500 each when fair
