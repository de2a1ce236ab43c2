"""Pick an endpoint and count it in flight in one step (no await in between).

`Picker` is a facade over two private halves: the `Ledger` (endpoints, loads,
samples, leases) and the `Scheduler` (policy, scorers, p2c, near ties,
saturation). Callers, the gateway's and the tests alike, use its methods only;
what they may read of the halves it gives as methods too (`speed`, `committed`,
`load`, `settings`).
`pick` is synchronous: it scores, chooses and claims before any other
coroutine can run, so two concurrent requests never both see the same "idle"
endpoint. The Scraper feeds samples in through `observe`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from time import perf_counter

from prometheus_client import CollectorRegistry

from modeldock.clock import Clock
from modeldock.errors import Unavailable
from modeldock.picking.ledger import Lease, Ledger
from modeldock.picking.metrics import PickerMetrics
from modeldock.picking.peers import Holding, PeerLoad
from modeldock.picking.policies import Weighted, make_policy
from modeldock.picking.registry import ScorerOptions, build_scorers
from modeldock.picking.relay import PageRelay, PeerPage
from modeldock.picking.saturation import Saturation
from modeldock.picking.scheduler import NEAR_TIE, Scheduler
from modeldock.picking.scorers import PickRequest, RequestScorer, Scorer
from modeldock.picking.signals import Load, Sample, Signals
from modeldock.types import Endpoint

__all__ = ["Lease", "Pick", "Picker", "PickerSettings"]


@dataclass(frozen=True)
class PickerSettings:
    """How a `Picker` was built, as its halves hold it (what `build_picker` passed arrives here)."""

    policy: str
    fallbacks: int
    stale_after: float
    stale_penalty: float | None  # None: a policy that does not score (round_robin)
    p2c_threshold: int
    near_tie: float | None  # None: not `default` (no near-tie rule)
    weights: dict[str, float]  # load scorers normalised to a sum of 1, request scorers as given
    saturation: Saturation | None  # None: never saturates
    request_scorers: tuple[str, ...]  # the request scorers on (`default` only), e.g. ("prefix",)


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
    weights: scorer name -> weight over the registry's defaults (registry.py),
      load scorers and request scorers (`prefix`) alike; scorers: a full
      replacement list of (load scorer, weight) instead of the load weights.
    stale_after: seconds after which a sample is ignored and the endpoint is
      scored from its in-flight count plus stale_penalty.
    p2c_threshold: above this many candidates, pick by power of two choices.
    saturation: reject when every candidate is over its limits (None: never).
    near_tie: `default` only: candidates scoring within this of the best, with
      no more requests in flight, are equal, and the least recently picked of
      them is the primary (0: exact ties only).
    prefix_weight: `default` only: the weight of prefix affinity (affinity.py),
      overriding `weights["prefix"]`; 0 turns it off.
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
        near_tie: float = NEAR_TIE,
        prefix_weight: float | None = None,
        prefix_capacity: int = 200_000,
        rng: random.Random | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if fallbacks < 0:
            raise ValueError("fallbacks must be >= 0")
        if near_tie < 0:
            raise ValueError("near_tie must be >= 0")
        if prefix_weight is not None and prefix_weight < 0:
            raise ValueError("prefix_weight must be >= 0")
        self._fallbacks = fallbacks
        self._ledger = Ledger(clock, stale_after)
        self._clock = clock
        self._target_listeners: list[Callable[[], None]] = []
        self._relay = PageRelay()  # own reads for the peers, and theirs applied here (relay.py)
        # Without a weight for it, prefix affinity is off: the config gives its default.
        merged = {"prefix": 0.0, **(weights or {})}
        if prefix_weight is not None:
            merged["prefix"] = prefix_weight
        built = build_scorers(merged, ScorerOptions(prefix_capacity=prefix_capacity))
        policy_impl = make_policy(policy, scorers if scorers is not None else built.load, stale_penalty)
        default = policy_impl.name == "default"
        # Request scorers and near ties: `default` only (the others are comparison baselines).
        request: list[tuple[RequestScorer, float]] = built.request if default else []
        self._scheduler = Scheduler(self._ledger, clock, policy_impl, request_scorers=request,
                                    p2c_threshold=p2c_threshold, saturation=saturation,
                                    near_tie=near_tie if default else None, rng=rng)
        self._metrics = PickerMetrics(registry, policy_impl.name, self._scheduler.rows)

    @property
    def policy(self) -> str:
        return self._scheduler.name

    @property
    def fallbacks(self) -> int:
        return self._fallbacks

    @property
    def settings(self) -> PickerSettings:
        scheduler = self._scheduler
        policy = scheduler.policy
        return PickerSettings(
            policy=scheduler.name, fallbacks=self._fallbacks, stale_after=self._ledger.stale_after,
            stale_penalty=policy.stale_penalty if isinstance(policy, Weighted) else None,
            p2c_threshold=scheduler.p2c_threshold, near_tie=scheduler.near_tie, weights=scheduler.weights,
            saturation=scheduler.saturation, request_scorers=scheduler.request_scorer_names())

    def request_scorer(self, name: str) -> RequestScorer | None:
        """The request scorer of that name when it is on (None otherwise)."""
        return self._scheduler.request_scorer(name)

    # -- endpoints and samples (the ledger's) -----------------------------

    def set_endpoints(self, model: str, endpoints: Sequence[Endpoint], served_name: str | None = None,
                      max_num_seqs: int | None = None) -> None:
        """Replace a model's candidates. `served_name` is the name the backend
        reports in its metrics' model_name label (default: `model`); `max_num_seqs`
        its backends' batch limit when the config declares it (else learned)."""
        before = self._ledger.live
        self._scheduler.forget(self._ledger.set_endpoints(model, endpoints, served_name, max_num_seqs))
        if self._ledger.live is not before:
            self._relay.forget(self._ledger.live)
        if self._target_listeners and self._ledger.live != before:
            for listener in self._target_listeners:
                listener()

    def add_target_listener(self, listener: Callable[[], None]) -> None:
        """Called when the set of endpoints changes (the scraper reads a new one's page at once)."""
        self._target_listeners.append(listener)

    def endpoints(self, model: str) -> tuple[Endpoint, ...]:
        return self._ledger.endpoints(model)

    def scrape_targets(self) -> dict[Endpoint, str | None]:
        return self._ledger.scrape_targets()

    def observe(self, endpoint: Endpoint, sample: Sample, taken_at: float, in_flight_at: int | None = None,
                out_of_turn: bool = False) -> None:
        """A fresh scrape, taken at `taken_at` when this gateway had `in_flight_at`
        requests on the endpoint (default: as many as now). Picks and completions
        after that correct the sample until the next one arrives. `out_of_turn`: read
        outside the scraper's rounds (`Scraper.refresh`): rates and the batch limit are
        learned from the rounds' pages only."""
        self._ledger.observe(endpoint, sample, taken_at, in_flight_at, out_of_turn)
        load = self._ledger.loads.get(endpoint)
        if load is not None and load.taken_at == taken_at:
            self._relay.record(endpoint, sample, taken_at, load.capacity, load.block, not out_of_turn)

    def pages(self, window: float = 5.0) -> tuple[PeerPage, ...]:
        """This replica's own reads of the last `window` seconds, the latest of each endpoint, for its
        peers (modeldock/sharing)."""
        return self._relay.pages(self._clock.monotonic(), window)

    def take_pages(self, reader: str, pages: Iterable[PeerPage], age: float) -> int:
        """Apply a peer's (`reader`'s) pages, its share `age` seconds old: each as if read here when
        `reader` read it, showing the requests picked here by then. Returns how many were new."""
        now = self._clock.monotonic()
        by_address = self._ledger.by_address()
        taken = 0
        for page in pages:
            ep = by_address.get(page.address)
            if ep is None or not self._relay.fresh(ep, reader, page.seq):
                continue
            at = now - max(0.0, age) - max(0.0, page.age)
            self._ledger.observe(ep, page.sample(), at, self._ledger.in_flight_before(ep, at), not page.rates)
            taken += 1
        return taken

    def sample_age(self, endpoint: Endpoint) -> float:
        """Seconds since `endpoint`'s last page, read here or relayed (inf: none)."""
        return self._clock.monotonic() - self._ledger.load(endpoint).taken_at

    def observe_failure(self, endpoint: Endpoint) -> None:
        """A failed scrape: the old sample stays and ages towards stale."""
        self._ledger.observe_failure(endpoint)

    def signals(self, endpoint: Endpoint) -> Signals:
        """What a scorer would see for `endpoint` now."""
        return self._ledger.signals(endpoint)

    def fullness(self, endpoint: Endpoint) -> float:
        """How full `endpoint` is as the pool counts it: the larger of its requests over its batch
        limit and its committed tokens over its KV capacity; 1.0 while neither is known."""
        s = self._ledger.signals(endpoint)
        full = -1.0
        if s.limit > 0:
            full = max(s.in_flight, s.running + s.waiting) / s.limit
        if s.capacity > 0:
            full = max(full, s.committed / s.capacity)
        return 1.0 if full < 0 else full

    def score(self, endpoint: Endpoint) -> float | None:
        """The endpoint's load score now (lower is better); None for round_robin."""
        return self._scheduler.score(endpoint)

    def in_flight(self, endpoint: Endpoint) -> int:
        return self._ledger.in_flight(endpoint)

    def total_in_flight(self) -> int:
        return self._ledger.total_in_flight()

    def total_committed(self) -> int:
        """Tokens committed by every request in flight."""
        return self._ledger.total_committed()

    def committed(self, endpoint: Endpoint) -> int:
        """Tokens committed by the requests in flight on `endpoint`."""
        return self._ledger.committed(endpoint)

    def speed(self, model: str) -> float:
        """How fast a queue of `model` drains, tokens/s: `max(drain, speed)` summed over its endpoints."""
        return self._ledger.speed(model)

    def load(self, endpoint: Endpoint) -> Load:
        """The endpoint's ledger entry, to read only (diagnostics and tests; an empty one if untracked)."""
        return self._ledger.load(endpoint)

    def loads(self) -> Mapping[Endpoint, Load]:
        """Every tracked endpoint's ledger entry, to read only."""
        return self._ledger.tracked()

    def holdings(self) -> list[Holding]:
        """This replica's own requests in flight per endpoint, for its peers (modeldock/sharing)."""
        return self._ledger.holdings()

    def set_peers(self, peers: Mapping[str, PeerLoad]) -> None:
        """The other replicas' holdings by endpoint address ({}: the local view alone). `signals`,
        scoring and the room rules count them from now on; the counts and metrics stay local."""
        self._ledger.set_peers(peers)

    def peers(self, endpoint: Endpoint) -> PeerLoad | None:
        return self._ledger.peers(endpoint)

    def add_peer_claim_listener(self, listener: Callable[[Endpoint], None]) -> None:
        """`listener(endpoint)` when the peers' holdings there grew (`set_peers`): the scraper's hurry."""
        self._ledger.add_peer_claim_listener(listener)

    def add_claim_listener(self, listener: Callable[[Endpoint], None]) -> None:
        """`listener(endpoint)` after every claim (pick or move), synchronously: the sharing loop's nudge."""
        self._ledger.add_claim_listener(listener)

    def add_room_listener(self, listener: Callable[[str], None]) -> None:
        """`listener(model)` hears, synchronously, that room may have appeared for `model`: a
        lease of it was released or moved, or a fresh sample arrived for one of its endpoints."""
        self._ledger.add_room_listener(listener)

    def add_release_listener(self, listener: Callable[[Endpoint], None]) -> None:
        """`listener(endpoint)` hears, synchronously, that a request counted there ended or moved away."""
        self._ledger.add_release_listener(listener)

    # -- picking ---------------------------------------------------------

    def require_endpoints(self, model: str, *, subset: frozenset[Endpoint] | None = None) -> tuple[Endpoint, ...]:
        """The model's endpoints (only those in `subset`, a gateway's hint, when given); 503 (counted as
        `no_endpoints`) when there are none."""
        candidates = self._ledger.endpoints(model)
        if subset is not None:
            candidates = tuple(e for e in candidates if e in subset)
        if not candidates:
            self._metrics.outcome["no_endpoints"].inc()
            raise Unavailable(f"No ready endpoints for model {model!r}.", code="no_ready_endpoints")
        return candidates

    def pick(self, model: str, prefix: Sequence[int] = (), *, cost: int = 0,
             subset: frozenset[Endpoint] | None = None, headroom: int = 0,
             headroom_tokens: int | None = None, prefer_fast: bool = False, output: int | None = None) -> Pick:
        """`prefix`: the prompt's block hashes (prefix.prompt_blocks), for prefix affinity;
        `cost`: the request's estimated tokens, committed on the endpoint while the lease holds;
        `subset`: pick only among these endpoints (the endpoint picker protocol's subset hint);
        `headroom`, `headroom_tokens`: slots and tokens to leave free on an endpoint for protected
        requests (the request's standing; saturation.py); `prefer_fast`: a protected request in
        contention, which passes over much slower near ties (scheduler.py); `output`: the part of
        `cost` that is its output limit (for the tokens rule, saturation.py).
        Raises `Saturated` (a 429/503 Rejection) when no candidate has room."""
        started = perf_counter()
        candidates = self.require_endpoints(model, subset=subset)
        request = PickRequest(model, tuple(prefix), cost, headroom, headroom_tokens, prefer_fast, output)
        ranked = self._scheduler.rank(request, candidates, 1 + self._fallbacks)
        if ranked is None:
            self._metrics.outcome["saturated"].inc()
            assert self._scheduler.saturation is not None
            raise self._scheduler.saturation.rejection(model, len(candidates))
        primary = ranked[0]
        result = Pick(primary, tuple(ranked[1:]), self._ledger.claim(model, primary, cost, min(output or 0, cost)))
        self._scheduler.picked(request, primary)
        self._metrics.outcome["picked"].inc()
        self._metrics.latency.observe(perf_counter() - started)
        return result
