"""The ledger: each model's endpoints, and per endpoint its requests in flight and last load sample.

Only the ledger changes counts: `claim` makes a `Lease`, and a lease moves or
releases through the ledger's public methods. Everything runs synchronously on
the event loop, so a pick's read-score-claim happens with no await in between.

Per-endpoint state lives in `signals.Load`. Committed tokens go beside the
request count there: `claim` takes the request's token estimate, the `Lease`
keeps it (a move takes it along), `Load.add/remove` sum it and `Signals` carry
it to the scorers and to saturation.

Room listeners (`add_room_listener`) hear "room may have appeared for model M"
synchronously when a lease of M is released or moved away, and when a sample
arrives for an endpoint of M; the gateway's queue dispatches from there.
Release listeners (`add_release_listener`) hear "a request on endpoint E ended
or moved away" (the scraper reads E's page again: the last one still counts it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from modeldock.clock import Clock
from modeldock.picking.peers import RECENT_SECONDS, Holding, PeerLoad
from modeldock.picking.signals import Load, Sample, Signals
from modeldock.types import Endpoint

NO_LOAD = Load()  # read-only stand-in for endpoints never counted or sampled


class Lease:
    """One request's claim on an endpoint of a model; released exactly once."""

    __slots__ = ("_ledger", "_seq", "endpoint", "model", "output", "released", "tokens")

    def __init__(self, ledger: Ledger, model: str, endpoint: Endpoint, seq: int, tokens: int = 0,
                 output: int = 0) -> None:
        self._ledger = ledger
        self.model = model
        self.endpoint = endpoint
        self.released = False
        self.tokens = tokens  # committed on `endpoint` while the lease holds
        self.output = output  # the part of `tokens` that is the output limit (0: not known)
        self._seq = seq  # the ledger's sequence number for this claim

    def move_to(self, address: str) -> bool:
        """Envoy reported that another endpoint served the request (after a retry).
        False when nothing moved: released, not an endpoint of this model now, or
        the one counted already."""
        if self.released:
            return False
        try:
            target = Endpoint.parse(address)
        except ValueError:
            return False
        if target == self.endpoint or not self._ledger.serves(self.model, target):
            return False
        self._seq = self._ledger.move(self.endpoint, self._seq, target, self.tokens, self.output)
        self.endpoint = target
        self._ledger.room(self.model)  # the endpoint it left has room again
        return True

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._ledger.drop(self.endpoint, self._seq)
            self._ledger.room(self.model)


class Ledger:
    """Owns endpoints per model, their loads and samples, and every claim on them."""

    def __init__(self, clock: Clock, stale_after: float = 2.0) -> None:
        if stale_after <= 0:
            raise ValueError("stale_after must be > 0")
        self._clock = clock
        self.stale_after = stale_after
        self._seq = 0  # claims so far: every claim's sequence number
        self._endpoints: dict[str, tuple[Endpoint, ...]] = {}
        self._members: dict[str, frozenset[Endpoint]] = {}
        self._served: dict[str, str] = {}
        self._limits: dict[str, int] = {}  # model -> its backends' declared batch limit (max_num_seqs)
        self._declared: dict[Endpoint, int] = {}  # endpoint -> the largest declared limit of its models
        self.live: frozenset[Endpoint] = frozenset()
        self._by_address: dict[str, Endpoint] = {}  # of `live`
        self.loads: dict[Endpoint, Load] = {}  # read directly by the scheduler's hot loop; never written there
        self._listeners: list[Callable[[str], None]] = []
        self._release_listeners: list[Callable[[Endpoint], None]] = []
        self._claim_listeners: list[Callable[[Endpoint], None]] = []
        self._peer_claim_listeners: list[Callable[[Endpoint], None]] = []
        self._picked_at: dict[int, float] = {}  # sequence number -> when claimed (the holdings' pick ages)
        self._peers: dict[Endpoint, PeerLoad] = {}  # the other replicas' holdings (`set_peers`)

    # -- room ------------------------------------------------------------

    def add_room_listener(self, listener: Callable[[str], None]) -> None:
        """`listener(model)`: room may have appeared for `model`. Called synchronously from
        release, move and observe: it must not raise and should only schedule work."""
        self._listeners.append(listener)

    def add_release_listener(self, listener: Callable[[Endpoint], None]) -> None:
        """`listener(endpoint)`: a request counted on `endpoint` ended or moved away. Called
        synchronously from release and move: it must not raise and should only schedule work."""
        self._release_listeners.append(listener)

    def add_claim_listener(self, listener: Callable[[Endpoint], None]) -> None:
        """`listener(endpoint)`: a request was counted there (a pick, or a move's new endpoint). Called synchronously
        from the claim: it must not raise and should only schedule work (the peers' exchange, sooner)."""
        self._claim_listeners.append(listener)

    def add_peer_claim_listener(self, listener: Callable[[Endpoint], None]) -> None:
        """`listener(endpoint)`: the peers hold more requests there than before (`set_peers`): the
        scraper puts it on the busy cadence, as after a pick here."""
        self._peer_claim_listeners.append(listener)

    def room(self, model: str) -> None:
        for listener in self._listeners:
            listener(model)

    # -- endpoints -------------------------------------------------------

    def set_endpoints(
        self, model: str, endpoints: Sequence[Endpoint], served_name: str | None = None,
        max_num_seqs: int | None = None,
    ) -> frozenset[Endpoint]:
        """Replace a model's candidates; the endpoints no model lists any more. `max_num_seqs`:
        the batch limit of the model's backends, when the config declares it (else learned)."""
        self._endpoints[model] = tuple(dict.fromkeys(endpoints))
        self._members[model] = frozenset(self._endpoints[model])
        self._served[model] = served_name or model
        if max_num_seqs:
            self._limits[model] = max_num_seqs
        else:
            self._limits.pop(model, None)
        before = self.live
        self.live = frozenset(ep for eps in self._endpoints.values() for ep in eps)
        if self.live != before:
            self._by_address = {ep.address: ep for ep in self.live}
        for ep in [ep for ep, load in self.loads.items() if ep not in self.live and load.in_flight == 0]:
            del self.loads[ep]
        declared: dict[Endpoint, int] = {}
        for name, limit in self._limits.items():
            for ep in self._endpoints.get(name, ()):
                declared[ep] = max(limit, declared.get(ep, 0))
        self._declared = declared
        for ep, load in self.loads.items():
            load.declare(declared.get(ep, 0))
        return before - self.live

    def endpoints(self, model: str) -> tuple[Endpoint, ...]:
        return self._endpoints.get(model, ())

    def serves(self, model: str, endpoint: Endpoint) -> bool:
        return endpoint in self._members.get(model, ())

    def scrape_targets(self) -> dict[Endpoint, str | None]:
        """Every current endpoint and the model name to read from its metrics (None: read
        whole, for an endpoint listed under several models: their load is shared)."""
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

    def observe(self, endpoint: Endpoint, sample: Sample, taken_at: float, in_flight_at: int | None = None,
                out_of_turn: bool = False) -> None:
        load = self.loads.get(endpoint)
        if load is None:
            if endpoint not in self.live:
                return  # left the snapshot while it was being scraped
            load = self.loads[endpoint] = self._new_load(endpoint)
        if taken_at < load.taken_at:
            return  # an older result than the one we hold
        load.learn(sample, taken_at, rates=not out_of_turn)
        load.sample = sample
        load.taken_at = taken_at
        load.rebase(self._seq, in_flight_at)
        load.failures = 0
        if self._listeners:
            for model, members in self._members.items():
                if endpoint in members:
                    self.room(model)

    def observe_failure(self, endpoint: Endpoint) -> None:
        load = self.loads.get(endpoint)
        if load is None:
            if endpoint not in self.live:
                return
            load = self.loads[endpoint] = self._new_load(endpoint)
        load.failures += 1

    def load(self, endpoint: Endpoint) -> Load:
        """The endpoint's state (a shared empty one when none is held): read only."""
        return self.loads.get(endpoint, NO_LOAD)

    def signals(self, endpoint: Endpoint, now: float | None = None) -> Signals:
        now = self._clock.monotonic() if now is None else now
        return self.loads.get(endpoint, NO_LOAD).signals(now, self.stale_after)

    # -- claims ----------------------------------------------------------

    def claim(self, model: str, endpoint: Endpoint, tokens: int = 0, output: int = 0) -> Lease:
        """Count one request, committing `tokens` (of which `output` is its output limit, when
        known), on `endpoint` for `model`."""
        return Lease(self, model, endpoint, self._add(endpoint, tokens, output), tokens, output)

    def move(self, endpoint: Endpoint, seq: int, target: Endpoint, tokens: int = 0, output: int = 0) -> int:
        """Move a claim and its tokens; the new claim's sequence number (new to `target`: counted
        like a pick there)."""
        self.drop(endpoint, seq)
        return self._add(target, tokens, output)

    def drop(self, endpoint: Endpoint, seq: int) -> None:
        load = self.loads.get(endpoint)
        if load is None:
            return
        if seq in load.leases:
            load.remove(seq)
            self._picked_at.pop(seq, None)
            for listener in self._release_listeners:
                listener(endpoint)
        if load.in_flight == 0 and endpoint not in self.live:
            del self.loads[endpoint]  # gone from the snapshot and nothing left to count

    def _add(self, endpoint: Endpoint, tokens: int = 0, output: int = 0) -> int:
        load = self.loads.get(endpoint)
        if load is None:
            load = self.loads[endpoint] = self._new_load(endpoint)
        self._seq += 1
        load.add(self._seq, tokens, output)
        self._picked_at[self._seq] = self._clock.monotonic()
        for listener in self._claim_listeners:
            listener(endpoint)
        return self._seq

    def _new_load(self, endpoint: Endpoint) -> Load:
        load = Load()
        load.declare(self._declared.get(endpoint, 0))
        peer = self._peers.get(endpoint)
        if peer is not None:
            load.set_peer(peer)
        return load

    # -- peers (other replicas' holdings: modeldock/sharing) ---------------

    def holdings(self) -> list[Holding]:
        """This replica's own requests in flight, per endpoint that has any (what its peers count)."""
        now = self._clock.monotonic()
        picked_at = self._picked_at
        out = []
        for ep, load in self.loads.items():
            if not load.leases:
                continue
            outputs = load.outputs
            picks = tuple((now - at, tokens, outputs.get(seq, 0)) for seq, tokens in load.leases.items()
                          if (at := picked_at.get(seq, now)) > now - RECENT_SECONDS)
            steps = load.steps
            ends = tuple((due - steps, load.leases[seq]) for seq, due in load.due.items())
            page_age = now - load.taken_at if load.taken_at > float("-inf") else -1.0
            out.append(Holding(ep.address, len(load.leases), load.committed, picks, ends, page_age))
        return out

    def set_peers(self, peers: Mapping[str, PeerLoad]) -> None:
        """The other replicas' holdings by address (empty: none, or no shared view: the local view).
        Where they hold less than before, room may have appeared: the room listeners hear it."""
        by_address = self._by_address
        now_peers: dict[Endpoint, PeerLoad] = {}
        for address, peer in peers.items():
            ep = by_address.get(address)
            if ep is not None:
                now_peers[ep] = peer
        freed: set[Endpoint] = set()
        for ep, before in self._peers.items():
            after = now_peers.get(ep)
            if after is None or after.in_flight < before.in_flight or after.committed < before.committed:
                freed.add(ep)
        if self._peer_claim_listeners:
            for ep, grown in now_peers.items():
                held = self._peers.get(ep)
                if grown.in_flight > (held.in_flight if held is not None else 0):
                    for listener in self._peer_claim_listeners:
                        listener(ep)
        # Only where the peers held or hold something: every other load has no peer part to change
        # (O(the peers' endpoints) per exchange, not O(the pool)).
        touched = self._peers.keys() | now_peers.keys()
        self._peers = now_peers
        for ep in touched:
            load = self.loads.get(ep)
            if load is None:
                load = self.loads[ep] = self._new_load(ep)  # takes its peer in _new_load
            else:
                load.set_peer(now_peers.get(ep))
        if freed and self._listeners:
            for model, members in self._members.items():
                if not freed.isdisjoint(members):
                    self.room(model)

    def by_address(self) -> Mapping[str, Endpoint]:
        """The live endpoints by `ip:port` (how peers name them)."""
        return self._by_address

    def in_flight_before(self, endpoint: Endpoint, at: float) -> int:
        """This replica's requests on `endpoint` now that were picked by `at` (a page read then shows them)."""
        load = self.loads.get(endpoint)
        if load is None:
            return 0
        picked_at = self._picked_at
        return sum(1 for seq in load.leases if picked_at.get(seq, at) <= at)

    def peers(self, endpoint: Endpoint) -> PeerLoad | None:
        """The other replicas' holdings on `endpoint` (None: none known)."""
        return self._peers.get(endpoint)

    def in_flight(self, endpoint: Endpoint) -> int:
        load = self.loads.get(endpoint)
        return load.in_flight if load is not None else 0

    def total_in_flight(self) -> int:
        return sum(load.in_flight for load in self.loads.values())

    def committed(self, endpoint: Endpoint) -> int:
        load = self.loads.get(endpoint)
        return load.committed if load is not None else 0

    def speed(self, model: str) -> float:
        """Tokens/second the model's endpoints process together when full: how fast a queue
        of it drains (per endpoint its rate while full, else while busy, if higher; one
        not learned yet adds nothing)."""
        loads = self.loads
        return sum(max(loads[ep].drain, loads[ep].speed) for ep in self._endpoints.get(model, ()) if ep in loads)

    def total_committed(self) -> int:
        return sum(load.committed for load in self.loads.values())

    def tracked(self) -> Mapping[Endpoint, Load]:
        return self.loads
