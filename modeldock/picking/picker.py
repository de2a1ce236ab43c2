"""Pick an endpoint and count it in flight in one step (no await in between).

The Picker owns the in-flight ledger and the latest load sample of every
endpoint. `pick` is synchronous: it scores, chooses and counts before any
other coroutine can run, so two concurrent requests never both see the same
"idle" endpoint. The Scraper feeds samples in through `observe`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter

from prometheus_client import CollectorRegistry

from modeldock.clock import Clock
from modeldock.types import Endpoint
from modeldock.errors import Unavailable
from modeldock.picking.metrics import EndpointRow, PickerMetrics
from modeldock.picking.policies import RoundRobin, ScoredPolicy, make_policy
from modeldock.picking.prefix import PrefixIndex
from modeldock.picking.saturation import Saturation
from modeldock.picking.scorers import Scorer, default_scorers
from modeldock.picking.signals import Load, Sample, Signals

_NO_LOAD = Load()  # read-only stand-in for endpoints never counted or sampled

# A ranking entry: (saturated, score, random tie-break, endpoint); tuples sort in that order.
_Keyed = tuple[bool, float, float, Endpoint]
# `default`: scores this close count as equal and the least recently picked wins (with no more in
# flight). Below one queued request's weight (0.4 * 1/5 = 0.08), so a real queue still decides;
# above the score of a stale KV reading of one request (routing benchmark trials: 0.03 left `shared`
# at 0.83x round robin, 0.06 at 0.99x, with `mixed` unchanged; see benchmarks/routing/README.md).
_NEAR_TIE = 0.06


class Lease:
    """One request's claim on an endpoint; released exactly once."""

    def __init__(self, picker: Picker, endpoint: Endpoint, seq: int) -> None:
        self._picker = picker
        self.endpoint = endpoint
        self.released = False
        self._seq = seq  # the picker's sequence number for this claim

    def move_to(self, address: str) -> bool:
        """Envoy reported that another endpoint served the request (after a retry).
        False when nothing moved: released, not an endpoint, or the one counted already."""
        if self.released:
            return False
        try:
            target = Endpoint.parse(address)
        except ValueError:
            return False
        if target == self.endpoint:
            return False
        self._picker._drop(self.endpoint, self._seq)
        self.endpoint = target
        self._seq = self._picker._claim(target)  # new to that endpoint: counted like a pick there
        return True

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._picker._drop(self.endpoint, self._seq)


@dataclass(frozen=True)
class Pick:
    primary: Endpoint
    fallbacks: tuple[Endpoint, ...]
    lease: Lease

    @property
    def endpoint_list(self) -> str:
        """The override_host list: primary first, then fallbacks."""
        return ",".join(e.address for e in (self.primary, *self.fallbacks))


class Picker:
    """Load-aware picking over the endpoints the xDS snapshot holds.

    policy: default | seed | least_request | round_robin (see policies.py).
    weights: scorer name -> weight for `default` (queue, kv, running, in_flight);
      scorers: full replacement list of (scorer, weight) instead.
    stale_after: seconds after which a sample is ignored and the endpoint is
      scored from its in-flight count plus stale_penalty.
    p2c_threshold: above this many candidates, pick by power of two choices.
    saturation: reject when every candidate is over its limits (None: never).
    near_tie: `default` only: candidates scoring within this of the best, with
      no more requests in flight, are equal, and the least recently picked of
      them is the primary (0: exact ties only).
    prefix_weight: `default` only: weight of prefix affinity (prefix.py) beside the
      load scorers' total of 1: the score becomes (1 - p) * load + p * miss with
      p = prefix_weight / (1 + prefix_weight), where some candidate has seen the
      prompt's beginning (otherwise load alone decides). 0: off.
    rng: tie-breaks and p2c sampling; inject a seeded one in tests.
    registry: where to export metrics (None: no metrics).
    """

    def __init__(
        self,
        clock: Clock,
        fallbacks: int = 2,
        *,
        policy: str = "default",
        weights: Mapping[str, float] | None = None,
        scorers: Sequence[tuple[Scorer, float]] | None = None,
        stale_after: float = 2.0,
        stale_penalty: float = 0.5,
        p2c_threshold: int = 32,
        saturation: Saturation | None = None,
        near_tie: float = _NEAR_TIE,
        prefix_weight: float = 0.0,
        prefix_capacity: int = 200_000,
        rng: random.Random | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if fallbacks < 0:
            raise ValueError("fallbacks must be >= 0")
        if stale_after <= 0:
            raise ValueError("stale_after must be > 0")
        if p2c_threshold < 2:
            raise ValueError("p2c_threshold must be >= 2")
        if near_tie < 0:
            raise ValueError("near_tie must be >= 0")
        if prefix_weight < 0:
            raise ValueError("prefix_weight must be >= 0")
        self._clock = clock
        self._fallbacks = fallbacks
        self._stale_after = stale_after
        self._p2c_threshold = p2c_threshold
        self._saturation = saturation if saturation is not None and saturation.enabled else None
        self._rng = rng if rng is not None else random.Random()
        if scorers is None and weights is not None:
            scorers = default_scorers(weights)
        self._policy: ScoredPolicy | RoundRobin = make_policy(policy, scorers, stale_penalty)
        # Least-recently-picked among near ties: only `default` (the others keep random ties).
        self._near_tie = near_tie if self._policy.name == "default" else None
        # Prefix affinity: `default` only, like near_tie (the others are comparison baselines).
        self._prefix_share = prefix_weight / (1.0 + prefix_weight) if self._policy.name == "default" else 0.0
        self._prefix = PrefixIndex(prefix_capacity) if self._prefix_share > 0 else None
        self._seq = 0  # picks (and moves) so far: every claim's sequence number
        self._endpoints: dict[str, tuple[Endpoint, ...]] = {}
        self._served: dict[str, str] = {}
        self._live: frozenset[Endpoint] = frozenset()
        self._loads: dict[Endpoint, Load] = {}
        self._metrics = PickerMetrics(registry, self._policy.name, self._rows)

    @property
    def policy(self) -> str:
        return self._policy.name

    # -- endpoints -------------------------------------------------------

    def set_endpoints(self, model: str, endpoints: Sequence[Endpoint], served_name: str | None = None) -> None:
        """Replace a model's candidates. `served_name` is the name the backend
        reports in its metrics' model_name label (default: `model`)."""
        self._endpoints[model] = tuple(dict.fromkeys(endpoints))
        self._served[model] = served_name or model
        before = self._live
        self._live = frozenset(ep for eps in self._endpoints.values() for ep in eps)
        if self._prefix is not None:
            for ep in before - self._live:
                self._prefix.forget(ep)
        for ep in [ep for ep, load in self._loads.items() if ep not in self._live and load.in_flight == 0]:
            del self._loads[ep]

    def endpoints(self, model: str) -> tuple[Endpoint, ...]:
        return self._endpoints.get(model, ())

    def scrape_targets(self) -> dict[Endpoint, str | None]:
        """Every current endpoint and the model name to read from its metrics.

        An endpoint listed under several models (one server, several names) is
        read whole (None): its load is shared by all of them."""
        targets: dict[Endpoint, str | None] = {}
        for model, eps in self._endpoints.items():
            served = self._served[model]
            for ep in eps:
                if ep in targets and targets[ep] != served:
                    targets[ep] = None
                else:
                    targets.setdefault(ep, served)
        return targets

    # -- samples ---------------------------------------------------------

    def observe(self, endpoint: Endpoint, sample: Sample, taken_at: float, in_flight_at: int | None = None) -> None:
        """A fresh scrape, taken at `taken_at` when this gateway had `in_flight_at`
        requests on the endpoint (default: as many as now). Picks and completions
        after that correct the sample until the next one arrives."""
        load = self._loads.get(endpoint)
        if load is None:
            if endpoint not in self._live:
                return  # left the snapshot while it was being scraped
            load = self._loads[endpoint] = Load()
        if taken_at < load.taken_at:
            return  # an older result than the one we hold
        load.sample = sample
        load.taken_at = taken_at
        load.rebase(self._seq, in_flight_at)
        load.failures = 0

    def observe_failure(self, endpoint: Endpoint) -> None:
        """A failed scrape: the old sample stays and ages towards stale."""
        load = self._loads.get(endpoint)
        if load is None:
            if endpoint not in self._live:
                return
            load = self._loads[endpoint] = Load()
        load.failures += 1

    def signals(self, endpoint: Endpoint) -> Signals:
        """What a scorer would see for `endpoint` now."""
        return self._loads.get(endpoint, _NO_LOAD).signals(self._clock.monotonic(), self._stale_after)

    def score(self, endpoint: Endpoint) -> float | None:
        """The endpoint's score now (lower is better); None for round_robin."""
        if isinstance(self._policy, RoundRobin):
            return None
        return self._policy.score(self.signals(endpoint))

    # -- picking ---------------------------------------------------------

    def require_endpoints(self, model: str) -> tuple[Endpoint, ...]:
        """The model's endpoints; 503 (counted as `no_endpoints`) when there are none."""
        candidates = self._endpoints.get(model)
        if not candidates:
            self._metrics.outcome["no_endpoints"].inc()
            raise Unavailable(f"No ready endpoints for model {model!r}.", code="no_ready_endpoints")
        return candidates

    def pick(self, model: str, prefix: Sequence[int] = ()) -> Pick:
        """`prefix`: the prompt's block hashes (prefix.prompt_blocks), for prefix affinity."""
        started = perf_counter()
        candidates = self.require_endpoints(model)
        count = 1 + self._fallbacks
        prefix = prefix if self._prefix is not None else ()
        if isinstance(self._policy, RoundRobin):
            ranked = self._round_robin(model, candidates, count)
        elif len(candidates) > self._p2c_threshold:
            ranked = self._two_choices(candidates, count, prefix)
        else:
            ranked = self._rank(candidates, count, prefix)
        if ranked is None:
            self._metrics.outcome["saturated"].inc()
            assert self._saturation is not None
            raise self._saturation.rejection(model, len(candidates))
        primary = ranked[0]
        result = Pick(primary, tuple(ranked[1:]), Lease(self, primary, self._claim(primary)))
        if prefix:
            assert self._prefix is not None
            self._prefix.record(prefix, primary)
        self._metrics.outcome["picked"].inc()
        self._metrics.latency.observe(perf_counter() - started)
        return result

    def _keyed(self, endpoints: Sequence[Endpoint], now: float, prefix: Sequence[int] = ()) -> list[_Keyed]:
        assert not isinstance(self._policy, RoundRobin)
        score = self._policy.score
        loads = self._loads
        stale_after = self._stale_after
        saturation = self._saturation
        rand = self._rng.random
        matched = self._prefix.matched(prefix, endpoints) if prefix and self._prefix is not None else None
        share = self._prefix_share
        keyed = []
        for ep in endpoints:
            s = loads.get(ep, _NO_LOAD).signals(now, stale_after)
            over = saturation.over(s) if saturation is not None else False
            value = score(s)
            if matched:  # some candidate has seen this prompt's beginning
                value = (1.0 - share) * value + share * (1.0 - matched.get(ep, 0) / len(prefix))
            keyed.append((over, value, rand(), ep))
        return keyed

    def _rank(self, candidates: Sequence[Endpoint], count: int, prefix: Sequence[int] = ()) -> list[Endpoint] | None:
        """Score everyone; best first, saturated last, equal scores in random order.
        With near_tie, the least recently picked of those near the best leads."""
        keyed = self._keyed(candidates, self._clock.monotonic(), prefix)
        keyed.sort()
        if keyed[0][0]:
            return None  # even the best is saturated
        if self._near_tie is not None:
            lead = self._least_recent(keyed)
            if lead:
                keyed.insert(0, keyed.pop(lead))
        return [k[3] for k in keyed[:count]]

    def _least_recent(self, ranked: list[_Keyed]) -> int:
        """Index of the least recently picked entry scoring within near_tie of
        ranked[0] (sorted, unsaturated) with no more requests in flight: when
        load cannot tell endpoints apart, picks are spaced out like round robin
        instead of landing at random. The in-flight count is exact and current
        (the score's sample terms may be a scrape old), so a near tie never
        sends a request to an endpoint holding more than the best one."""
        assert self._near_tie is not None
        limit = ranked[0][1] + self._near_tie
        loads = self._loads
        best = loads.get(ranked[0][3], _NO_LOAD)
        lead, oldest, most = 0, best.last_pick, best.in_flight
        for i in range(1, len(ranked)):
            over, score, _, ep = ranked[i]
            if over or score > limit:
                break
            load = loads.get(ep, _NO_LOAD)
            if load.last_pick < oldest and load.in_flight <= most:
                lead, oldest = i, load.last_pick
        return lead

    def _two_choices(self, candidates: Sequence[Endpoint], count: int,
                     prefix: Sequence[int] = ()) -> list[Endpoint] | None:
        """Power of two choices: the better of two random candidates is the
        primary; the loser and a few more random ones, ranked, are fallbacks.
        With prefix affinity, the endpoints that saw the prompt's beginning
        (at most OWNERS_PER_BLOCK) contend too, so affinity works in big pools."""
        drawn = self._rng.sample(candidates, min(len(candidates), count + 1))
        contenders = drawn[:2]
        if prefix and self._prefix is not None:
            seen = self._prefix.matched(prefix[:1], candidates)
            contenders = list(dict.fromkeys([*seen, *contenders]))
        now = self._clock.monotonic()
        ranked = sorted(self._keyed(contenders, now, prefix))
        primary = ranked[0]
        if primary[0]:
            return self._rank(candidates, count, prefix)  # every contender is saturated: rare, so look at all
        rest = ranked[1:] + self._keyed([ep for ep in drawn[2:] if ep not in contenders], now, prefix)
        rest.sort()
        return [primary[3], *(k[3] for k in rest[: count - 1])]

    def _round_robin(self, model: str, candidates: Sequence[Endpoint], count: int) -> list[Endpoint] | None:
        assert isinstance(self._policy, RoundRobin)
        saturation = self._saturation
        if saturation is None:
            return self._policy.order(model, candidates, count)
        ordered = self._policy.order(model, candidates, len(candidates))
        now = self._clock.monotonic()
        over = {ep for ep in ordered if saturation.over(self._loads.get(ep, _NO_LOAD).signals(now, self._stale_after))}
        if len(over) == len(ordered):
            return None
        return ([ep for ep in ordered if ep not in over] + [ep for ep in ordered if ep in over])[:count]

    # -- ledger ----------------------------------------------------------

    def in_flight(self, endpoint: Endpoint) -> int:
        load = self._loads.get(endpoint)
        return load.in_flight if load is not None else 0

    def total_in_flight(self) -> int:
        return sum(load.in_flight for load in self._loads.values())

    def _claim(self, endpoint: Endpoint) -> int:
        """Count one request on `endpoint`; its sequence number."""
        load = self._loads.get(endpoint)
        if load is None:
            load = self._loads[endpoint] = Load()
        self._seq += 1
        load.add(self._seq)
        return self._seq

    def _drop(self, endpoint: Endpoint, seq: int) -> None:
        load = self._loads.get(endpoint)
        if load is None:
            return
        load.remove(seq)
        if load.in_flight == 0 and endpoint not in self._live:
            del self._loads[endpoint]  # gone from the snapshot and nothing left to count

    def _rows(self) -> list[EndpointRow]:
        now = self._clock.monotonic()
        rows = []
        for ep in sorted(self._live | self._loads.keys()):
            load = self._loads.get(ep, _NO_LOAD)
            age = now - load.taken_at if load.sample is not None else None
            rows.append(EndpointRow(ep.address, load.in_flight, self.score(ep), age, load.failures))
        return rows
