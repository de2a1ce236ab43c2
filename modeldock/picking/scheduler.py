"""The scheduler: rank a model's candidates for one request.

It owns the policy (policies.py), the request scorers beside it, power of two
choices for big pools, the near-tie rule and saturation. It reads the ledger's
loads and never changes them: the picker claims the winner.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from modeldock.clock import Clock
from modeldock.picking.ledger import NO_LOAD, Ledger
from modeldock.picking.metrics import EndpointRow
from modeldock.picking.policies import RoundRobin, ScoredPolicy
from modeldock.picking.saturation import Saturation
from modeldock.picking.scorers import PickRequest, RequestScorer
from modeldock.types import Endpoint

# A ranking entry: (saturated, score, random tie-break, endpoint); tuples sort in that order.
_Keyed = tuple[bool, float, float, Endpoint]
# `default`: scores this close count as equal and the least recently picked wins (with no more in
# flight). Below one queued request's weight (0.4 * 1/5 = 0.08), so a real queue still decides;
# above the score of a stale KV reading of one request (routing benchmark trials: 0.03 left `shared`
# at 0.83x round robin, 0.06 at 0.99x, with `mixed` unchanged; see benchmarks/routing/README.md).
NEAR_TIE = 0.06
# Near ties slower than this share of the fastest near tie's learned speed are not spaced into.
SLOWER = 0.8


@runtime_checkable
class Nominator(Protocol):
    """A request scorer that names extra contenders for power of two choices."""

    def nominate(self, request: PickRequest, candidates: Sequence[Endpoint]) -> list[Endpoint]: ...


@runtime_checkable
class Recorder(Protocol):
    """A request scorer that learns from picks and forgets endpoints that leave."""

    def picked(self, request: PickRequest, endpoint: Endpoint) -> None: ...

    def forget(self, endpoints: Iterable[Endpoint]) -> None: ...


class Scheduler:
    """policy: a scored policy or RoundRobin. request_scorers: (scorer, weight) beside
    the policy's load score, which counts as weight 1: with scorers r active for a
    request (not None), score = (1 - sum p_r) * load + sum p_r * value_r, where
    p_r = w_r / (1 + sum of the active weights). near_tie: None turns the rule off."""

    def __init__(self, ledger: Ledger, clock: Clock, policy: ScoredPolicy | RoundRobin, *,
                 request_scorers: Sequence[tuple[RequestScorer, float]] = (), p2c_threshold: int = 32,
                 saturation: Saturation | None = None, near_tie: float | None = NEAR_TIE,
                 rng: random.Random | None = None) -> None:
        if p2c_threshold < 2:
            raise ValueError("p2c_threshold must be >= 2")
        if near_tie is not None and near_tie < 0:
            raise ValueError("near_tie must be >= 0")
        if any(w < 0 for _, w in request_scorers):
            raise ValueError("request scorer weights must be >= 0")
        self._ledger = ledger
        self._clock = clock
        self.policy = policy
        self._request_scorers = [(s, w) for s, w in request_scorers if w > 0]
        self._nominators = [s for s, _ in self._request_scorers if isinstance(s, Nominator)]
        self._recorders = [s for s, _ in self._request_scorers if isinstance(s, Recorder)]
        self._p2c_threshold = p2c_threshold
        self.saturation = saturation if saturation is not None and saturation.enabled else None
        self._near_tie = near_tie
        self._rng = rng if rng is not None else random.Random()

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def p2c_threshold(self) -> int:
        return self._p2c_threshold

    @property
    def near_tie(self) -> float | None:
        return self._near_tie

    @property
    def weights(self) -> dict[str, float]:
        """Scorer name -> weight in use: the load scorers' normalised to a total of 1
        (`default` only), the request scorers' beside them."""
        load = getattr(self.policy, "scorers", [])
        return {**{s.name: w for s, w in load}, **{s.name: w for s, w in self._request_scorers}}

    def request_scorer(self, name: str) -> RequestScorer | None:
        return next((s for s, _ in self._request_scorers if s.name == name), None)

    def request_scorer_names(self) -> tuple[str, ...]:
        return tuple(s.name for s, _ in self._request_scorers)

    def score(self, endpoint: Endpoint) -> float | None:
        """The endpoint's load score now (lower is better); None for round_robin."""
        if isinstance(self.policy, RoundRobin):
            return None
        return self.policy.score(self._ledger.signals(endpoint))

    # -- ranking ---------------------------------------------------------

    def rank(self, request: PickRequest, candidates: Sequence[Endpoint], count: int) -> list[Endpoint] | None:
        """Up to `count` distinct candidates, best first; None when all are saturated."""
        if isinstance(self.policy, RoundRobin):
            return self._round_robin(request, candidates, count)
        if len(candidates) > self._p2c_threshold:
            return self._two_choices(request, candidates, count)
        return self._rank(request, candidates, count)

    def picked(self, request: PickRequest, endpoint: Endpoint) -> None:
        for recorder in self._recorders:
            recorder.picked(request, endpoint)

    def forget(self, endpoints: Iterable[Endpoint]) -> None:
        gone = list(endpoints)
        if gone:
            for recorder in self._recorders:
                recorder.forget(gone)

    def _keyed(self, request: PickRequest, endpoints: Sequence[Endpoint], now: float) -> list[_Keyed]:
        assert not isinstance(self.policy, RoundRobin)
        score = self.policy.score
        loads = self._ledger.loads
        stale_after = self._ledger.stale_after
        saturation = self.saturation
        cost = request.cost
        headroom, reserve, output = request.headroom, request.headroom_tokens, request.output
        rand = self._rng.random
        signals = [loads.get(ep, NO_LOAD).signals(now, stale_after) for ep in endpoints]
        keep, mixes = self._mixes(request, endpoints, signals) if self._request_scorers else (1.0, [])
        keyed = []
        for i, ep in enumerate(endpoints):
            s = signals[i]
            over = saturation.over(s, cost, headroom, reserve, output) if saturation is not None else False
            value = score(s)
            if mixes:  # some request scorer has an opinion on this request
                value = keep * value
                for share, values in mixes:
                    value += share * values[i]
            keyed.append((over, value, rand(), ep))
        return keyed

    def _mixes(self, request: PickRequest, endpoints: Sequence[Endpoint],
               signals: Sequence[object]) -> tuple[float, list[tuple[float, Sequence[float]]]]:
        active = []
        for scorer, weight in self._request_scorers:
            values = scorer.score(request, endpoints, signals)  # type: ignore[arg-type]
            if values is not None:
                active.append((weight, values))
        if not active:
            return 1.0, []
        total = sum(w for w, _ in active)
        mixes = [(w / (1.0 + total), values) for w, values in active]
        return 1.0 - sum(share for share, _ in mixes), mixes

    def _rank(self, request: PickRequest, candidates: Sequence[Endpoint], count: int) -> list[Endpoint] | None:
        """Score everyone; best first, saturated last, equal scores in random order.
        With near_tie, the least recently picked of those near the best leads."""
        keyed = self._keyed(request, candidates, self._clock.monotonic())
        keyed.sort()
        if keyed[0][0]:
            return None  # even the best is saturated
        if self._near_tie is not None:
            lead = self._least_recent(keyed, request.prefer_fast)
            if lead:
                keyed.insert(0, keyed.pop(lead))
        return [k[3] for k in keyed[:count]]

    def _least_recent(self, ranked: list[_Keyed], prefer_fast: bool = False) -> int:
        """Index of the least recently picked entry scoring within near_tie of
        ranked[0] (sorted, unsaturated) with no more requests in flight: when
        load cannot tell endpoints apart, picks are spaced out like round robin
        instead of landing at random. The in-flight count is exact and current
        (the score's sample terms may be a scrape old), so a near tie never
        sends a request to an endpoint holding more than the best one.

        For a request with `prefer_fast` (protected while others must leave it
        room), speed breaks the tie first: a near tie under SLOWER of the
        fastest one's learned speed is passed over (at equal load a faster
        backend gives the first token sooner: its steps are shorter). It still
        leads when it holds fewer requests than the others. Only those requests:
        steering everyone to the fast backends piles batches there (measured:
        TTFT p95 1.2x below capacity, 2x under overload)."""
        assert self._near_tie is not None
        limit = ranked[0][1] + self._near_tie
        loads = self._ledger.loads
        near = []  # the near ties' loads, best first (ranked[0] is unsaturated: _rank checked)
        for over, score, _, ep in ranked:
            if over or score > limit:
                break
            near.append(loads.get(ep, NO_LOAD))
        # 0 while no speed is known (or not asked): nobody is passed over.
        floor = max(load.speed for load in near) * SLOWER if prefer_fast else 0.0
        best = near[0]
        lead, oldest, most = 0, best.last_pick, best.in_flight
        slow = 0 < best.speed < floor
        for i in range(1, len(near)):
            load = near[i]
            if load.in_flight > most or 0 < load.speed < floor:
                continue
            if slow or load.last_pick < oldest:
                lead, oldest, slow = i, load.last_pick, False
        return lead

    def _two_choices(self, request: PickRequest, candidates: Sequence[Endpoint], count: int) -> list[Endpoint] | None:
        """Power of two choices: the better of two random candidates is the
        primary; the loser and a few more random ones, ranked, are fallbacks.
        Nominators (prefix affinity: the endpoints that saw the prompt's
        beginning) add contenders, so affinity works in big pools."""
        drawn = self._rng.sample(candidates, min(len(candidates), count + 1))
        contenders = drawn[:2]
        for nominator in self._nominators:
            seen = nominator.nominate(request, candidates)
            if seen:
                contenders = list(dict.fromkeys([*seen, *contenders]))
        now = self._clock.monotonic()
        ranked = sorted(self._keyed(request, contenders, now))
        primary = ranked[0]
        if primary[0]:
            return self._rank(request, candidates, count)  # every contender is saturated: rare, so look at all
        rest = ranked[1:] + self._keyed(request, [ep for ep in drawn[2:] if ep not in contenders], now)
        rest.sort()
        return [primary[3], *(k[3] for k in rest[: count - 1])]

    def _round_robin(self, request: PickRequest, candidates: Sequence[Endpoint], count: int) -> list[Endpoint] | None:
        assert isinstance(self.policy, RoundRobin)
        saturation = self.saturation
        if saturation is None:
            return self.policy.order(request.model, candidates, count)
        ordered = self.policy.order(request.model, candidates, len(candidates))
        now = self._clock.monotonic()
        over = {ep for ep in ordered if saturation.over(self._ledger.signals(ep, now), request.cost,
                                                            request.headroom, request.headroom_tokens, request.output)}
        if len(over) == len(ordered):
            return None
        return ([ep for ep in ordered if ep not in over] + [ep for ep in ordered if ep in over])[:count]

    # -- metrics ---------------------------------------------------------

    def rows(self) -> list[EndpointRow]:
        now = self._clock.monotonic()
        ledger = self._ledger
        rows = []
        for ep in sorted(ledger.live | ledger.loads.keys()):
            load = ledger.load(ep)
            age = now - load.taken_at if load.sample is not None else None
            rows.append(EndpointRow(ep.address, load.in_flight, self.score(ep), age, load.failures,
                                    load.committed, load.capacity, load.speed))
        return rows
