"""What picking knows about one endpoint: the last scraped sample and local counts."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from modeldock.picking.peers import PeerLoad

# A prompt is prefilled in chunks of at least this many tokens per engine step (vLLM's step
# budget, max_num_batched_tokens, is larger), and only its last chunk's step yields a token.
PREFILL_CHUNK = 512


@dataclass(frozen=True, slots=True)
class Sample:
    """One scrape of a vLLM server, summed over its engines."""

    waiting: float  # requests queued (vllm:num_requests_waiting)
    running: float  # sequences in the running batch (vllm:num_requests_running)
    kv: float  # KV-cache usage as a 0..1 fraction
    # KV capacity in tokens (vllm:cache_config_info: num_gpu_blocks x block_size); None: not read
    # this time (the scraper reads it rarely: it never changes while the server runs).
    capacity: float | None = None
    # vllm:prompt_tokens_total + vllm:generation_tokens_total (counters); None: not on the page.
    tokens_total: float | None = None
    # vllm:generation_tokens_total alone: how fast running sequences grow their KV; None: not on the page.
    generated_total: float | None = None
    # Tokens per KV block (cache_config_info's block_size), read with `capacity`; None: not read.
    block_size: int | None = None


class _SignalFields(NamedTuple):
    """Signals' fields in their groups (`SIGNAL_GROUPS`); build `Signals` by keyword, not this."""

    # -- sample: the last page, corrected; all 0 when not fresh (but `sample`, the raw page) --
    fresh: bool  # True when the sample is younger than stale_after
    sample: Sample | None  # the raw latest sample, whatever its age
    waiting: float = 0.0  # corrected estimate
    running: float = 0.0  # corrected estimate
    kv: float = 0.0  # from the sample, not corrected
    # The backend's own queue now: the sample's `waiting` less the completions since (each one lets a
    # waiting request in); picks since are not in it.
    backlog: float = 0.0
    # Committed tokens of the requests in the sample that finished since: KV the sample's `kv` still
    # counts but the backend has freed (at most: a request may have held less than its limit).
    gone_tokens: int = 0
    # KV the sample counts that requests finished since had held when it was read, as far as known
    # (`Load.freed`).
    freed: float = 0.0
    age: float = 0.0  # seconds since the sample was taken
    # -- counts: this gateway's requests there now --
    in_flight: int = 0  # requests this gateway has on it now
    committed: int = 0  # tokens (prompt + output limit) of this gateway's requests in flight here
    new_tokens: int = 0  # committed tokens of requests picked since the sample (not in its KV yet)
    # The output limits within `new_tokens` (of the picks that said theirs): not in any cache yet.
    new_outputs: int = 0
    # -- progress: the endpoint's engine steps --
    steps: float = 0.0  # the endpoint's engine steps counted so far (a lower bound; `Load.steps`)
    # (step by which it is done, committed tokens) of this gateway's requests there that said their
    # output limit, soonest first, on the endpoint's step count (`steps`): each is done within its
    # output limit of steps, less the steps the pages showed it running, and frees its KV then.
    ends: Sequence[tuple[float, int]] = ()
    # -- rates: what the pages taught about the endpoint (0: unknown) --
    capacity: float = 0.0  # KV capacity in tokens
    block: int = 0  # tokens per KV block: each sequence may hold up to block - 1 more than its tokens
    speed: float = 0.0  # tokens/second the endpoint processed while busy (its counters)
    # Output tokens/second while busy (vllm:generation_tokens_total): how fast the KV of the
    # sequences running there grows.
    growth: float = 0.0
    limit: float = 0.0  # batch limit: declared, or the most `running` seen while requests waited



class Signals(_SignalFields):
    """One endpoint as a scorer sees it at pick time; built by keyword only.

    Four groups (`SIGNAL_GROUPS`): the **sample** (what the endpoint's last /metrics page said,
    corrected for what happened since, and its age; all 0 when not fresh but `sample`, the raw
    page), the **counts** (this gateway's requests in flight there and their tokens), the
    **progress** (engine steps and when each request is done) and the **rates** (what the pages
    taught about the endpoint: capacity, speeds, batch limit; 0: unknown).

    Flat and a tuple underneath: one is built per candidate per pick, and `Load.signals` builds it
    with `tuple.__new__` from the fields in their declared order (the one positional builder, next
    to the declaration); by keyword it costs several times that, as nested groups or a dataclass
    would (benchmarks/picking.py). `_replace` makes a changed copy.
    """

    __slots__ = ()

    def __new__(cls, *, fresh: bool, sample: Sample | None, waiting: float = 0.0, running: float = 0.0,
                kv: float = 0.0, backlog: float = 0.0, gone_tokens: int = 0, freed: float = 0.0, age: float = 0.0,
                in_flight: int = 0, committed: int = 0, new_tokens: int = 0, new_outputs: int = 0,
                steps: float = 0.0, ends: Sequence[tuple[float, int]] = (),
                capacity: float = 0.0, block: int = 0, speed: float = 0.0, growth: float = 0.0,
                limit: float = 0.0) -> Signals:
        return tuple.__new__(cls, (fresh, sample, waiting, running, kv, backlog, gone_tokens, freed, age,
                                   in_flight, committed, new_tokens, new_outputs, steps, ends,
                                   capacity, block, speed, growth, limit))


SIGNAL_GROUPS: dict[str, tuple[str, ...]] = {
    "sample": ("fresh", "sample", "waiting", "running", "kv", "backlog", "gone_tokens", "freed", "age"),
    "counts": ("in_flight", "committed", "new_tokens", "new_outputs"),
    "progress": ("steps", "ends"),
    "rates": ("capacity", "block", "speed", "growth", "limit"),
}


# Builds `Signals` from its fields in declared order, skipping the keyword `__new__` (hot path only).
_build = tuple.__new__


def correct(sample: Sample, new: int, gone: int = 0) -> tuple[float, float]:
    """(waiting, running) estimated from the sample and what happened since.

    `new`: requests picked since the sample and still in flight. They are
    assumed queued (conservative: they may still be prefilling, and a burst of
    picks between scrapes makes the endpoint look busier right away).
    `gone`: requests that were in flight at the sample and have finished since;
    they come off the running batch first, then off the sample's queue, never
    below zero (they never cancel `new`: picks and completions are counted
    apart, so a sample whose requests all turned over still shows the new ones).
    A negative `new` is read as completions (the older net-delta form).
    """
    if new < 0:
        new, gone = 0, gone - new
    waiting = sample.waiting
    running = sample.running - gone
    if running < 0:
        waiting = max(0.0, waiting + running)
        running = 0.0
    return waiting + new, running


class Load:
    """Mutable per-endpoint ledger; only touched synchronously on the event loop.

    Every lease carries a pick sequence number (`Picker` counts picks). `mark`
    is the last sequence number the current sample already reflects: a lease
    above it was picked since the sample (`new` while in flight), one at or
    below it was in the sample (`gone` once it finishes).
    """

    # Grouped as `Signals` is: counts, sample, progress, rates (the attributes stay flat: `add` and
    # `remove` run on every pick and release).
    __slots__ = (
        # counts: this gateway's requests here
        "leases", "outputs", "committed", "new", "new_tokens", "new_outputs", "gone", "gone_tokens", "last_pick",
        # sample: the last page and how it is corrected
        "sample", "taken_at", "mark", "whole", "freed", "failures",
        # progress: engine steps and when each request is done
        "steps", "stepped", "step_rate", "peak", "due", "ends", "running",
        # rates: what the pages teach, and the counter readings they are learned from
        "capacity", "block", "speed", "growth", "drain", "limit", "declared", "learned", "counter", "counted_at",
        "generated", "produced",
        # peers: the other replicas' requests here (peers.py; set by `set_peer`, 0 with no peers)
        "peer_in_flight", "peer_committed", "peer_picks", "peer_ends", "peer_new", "peer_new_tokens",
        "peer_new_outputs", "peer_hidden",
    )

    def __init__(self) -> None:
        # -- counts --
        self.leases: dict[int, int] = {}  # sequence number -> committed tokens, of the requests in flight here
        self.outputs: dict[int, int] = {}  # sequence number -> the output limit within them, when known
        self.committed = 0  # sum of the leases' tokens
        self.new = 0  # in flight and picked after `mark`
        self.new_tokens = 0  # tokens of the leases above `mark`
        self.new_outputs = 0  # the output limits of the leases above `mark`
        self.gone = 0  # in flight at the sample, finished since
        self.gone_tokens = 0  # their committed tokens
        self.last_pick = 0  # sequence number of the latest pick here (0: never)
        # -- sample --
        self.sample: Sample | None = None
        self.taken_at = float("-inf")  # monotonic time of the sample
        self.mark = 0  # last pick sequence number the sample reflects
        self.whole = False  # the sample showed every request of this gateway's in flight when it was read
        self.freed = 0.0  # what those gone that the sample showed in the batch held then (`remove`)
        self.failures = 0  # consecutive scrape failures
        # -- progress --
        self.steps = 0.0  # engine steps counted so far (`learn`), a lower bound
        self.stepped = 0.0  # steps between the last two pages, not counted into `steps` yet
        self.step_rate = 0.0  # steps per second between the last two pages that counted any (0: unknown)
        self.peak = 0  # the most requests in flight here since the last page
        self.due: dict[int, float] = {}  # sequence number -> the step by which it is done (its key in `ends`)
        self.ends: list[tuple[float, int]] = []  # Signals.ends, kept sorted (read only outside)
        self.running: set[int] = set()  # of those, the ones the last page showed running
        # -- rates --
        self.capacity = 0.0  # KV capacity in tokens, once a page said it (0: unknown)
        self.block = 0  # tokens per KV block, read with the capacity (0: unknown)
        self.speed = 0.0  # tokens/second while busy, smoothed (0: unknown)
        self.growth = 0.0  # output tokens/second while busy, smoothed (0: unknown)
        self.drain = 0.0  # tokens/s while full (waiting or at the batch limit at both pages), smoothed; 0: unknown
        self.limit = 0.0  # the most requests seen running while others waited (0: not seen yet)
        self.declared = 0.0  # the batch limit the config gives (models[].max_num_seqs; 0: none, learn it)
        self.learned: Sample | None = None  # the last page learned from (a round's, not one out of turn)
        self.counter: float | None = None  # the last token counter reading and when it was taken
        self.counted_at = 0.0
        self.generated: float | None = None  # the output token counter at the last page learned from
        self.produced: float | None = None  # the output token counter at the last page
        # -- peers (other replicas, summed; see `set_peer`) --
        self.peer_in_flight = 0
        self.peer_committed = 0
        self.peer_picks: tuple[tuple[float, int, int], ...] = ()  # (picked at, tokens, output), recent ones
        self.peer_ends: tuple[tuple[float, int], ...] = ()  # their entries in `ends`, on this step count
        self.peer_new = 0  # of their picks, those after the sample (not in it yet), and their tokens
        self.peer_hidden = 0  # picked before the sample, but missing from it (on their way): `_hidden`
        self.peer_new_tokens = 0
        self.peer_new_outputs = 0

    @property
    def in_flight(self) -> int:
        return len(self.leases)

    def add(self, seq: int, tokens: int = 0, output: int = 0) -> None:
        self.leases[seq] = tokens
        self.committed += tokens
        self.new += 1  # seq is the newest number: always above the mark
        self.new_tokens += tokens
        if output:
            self.outputs[seq] = output
            self.new_outputs += output
            # Done within `output` steps from the first page that shows it running, and a long
            # prompt's chunks before its first token; until that page the count does not start.
            due = self.due[seq] = self.steps + output + max(0, tokens - output - 1) // PREFILL_CHUNK
            insort(self.ends, (due, tokens))
        if len(self.leases) > self.peak:
            self.peak = len(self.leases)
        self.last_pick = seq

    def remove(self, seq: int) -> int:
        """Drop one lease; the tokens it had committed (0 if it was not here).

        A request the sample showed in the batch (`running`) held at least its prompt and the
        output its counted steps credit it with when the sample was read, and that KV is free
        now: `freed` takes it off the sample's KV until the next page. Only a lower bound: its
        committed tokens would over-credit a request that stopped before its limit, and one the
        sample did not show in the batch may not have held anything then. Nor when the sample
        showed fewer requests than this gateway had there (`whole`): one may have finished before
        it was read (the backend frees a request's KV before its last bytes reach the gateway),
        and its KV is not in the sample."""
        if seq not in self.leases:
            return 0
        tokens = self.leases.pop(seq)
        output = self.outputs.pop(seq, 0)
        if output:
            ends = self.ends
            due = self.due.pop(seq)
            del ends[bisect_left(ends, (due, tokens))]
            if seq in self.running:
                self.running.remove(seq)
                if self.whole:
                    self.freed += tokens - min(float(output), max(0.0, due - self.steps))
        self.committed -= tokens
        if seq > self.mark:
            self.new -= 1
            self.new_tokens -= tokens
            self.new_outputs -= output
        else:
            self.gone += 1
            self.gone_tokens += tokens
        return tokens

    def learn(self, sample: Sample, taken_at: float, rates: bool = True) -> None:
        """Capacity, steps, batch limit and speed from a page: capacity as read; the steps since
        the last page (`_count_steps`) from every page; the rest only from pages read in the
        scraper's rounds (`rates`; not one read out of turn, perhaps milliseconds after the last:
        a rate over a few steps is noise, and two pages of a queue that close apart are one
        moment, not a queue that lasted). The batch limit is the
        most requests seen running while requests waited for a slot in two pages in a row (a
        queue that lasted, not one caught between a request's arrival and the server's next
        step: that would learn a limit far too low), the server's max_num_seqs. A queue waits
        for a slot when the KV cache has room for a typical request (`_waits_for_slots`); one
        waiting for memory is the KV bound of those requests, which the token rules follow as it
        changes (learned as a limit, a cache full of long generations once kept the short ones
        that came later to fewer slots for good). Running above the limit raises it. Speed from
        the token counters between two pages, only over intervals the server was busy (an idle
        server's rate says nothing about how fast it can go), smoothed (EWMA 0.3); growth likewise from
        the output token counter alone (the rate the running sequences' KV grows). A counter
        going backwards (a restart) starts over, the limit too (back to the declared one).
        A declared limit (`declare`, the config's max_num_seqs) stands in for the learning: a
        backend the gateway keeps from queueing may never show its limit."""
        if sample.capacity is not None:
            self.capacity = sample.capacity
            self.block = sample.block_size or 0
        produced, last, page = sample.generated_total, self.produced, self.sample
        self.produced = produced
        if page is not None and last is not None and produced is not None and produced > last:
            # Each running sequence gains at most one token per step: the steps since the last page
            # were at least the tokens produced over the most requests there at once.
            self.stepped = (produced - last) / max(page.running, sample.running, float(self.peak), 1.0)
            if taken_at > self.taken_at:
                self.step_rate = self.stepped / (taken_at - self.taken_at)
        if not rates:
            return
        total = sample.tokens_total
        if total is not None and self.counter is not None and total < self.counter:
            self.limit = self.declared  # restarted: perhaps with another max_num_seqs
        before, self.learned = self.learned, sample
        if sample.running > self.limit and (
            self.limit > 0 or (before is not None and self._waits_for_slots(sample) and self._waits_for_slots(before))
        ):
            self.limit = sample.running
        if total is None:
            return
        previous, since, generated = self.counter, self.counted_at, self.generated
        self.counter, self.counted_at, self.generated = total, taken_at, sample.generated_total
        if previous is None or taken_at <= since or total < previous:
            return
        busy = sample.running > 0 or (before is not None and before.running > 0)
        if not busy or total == previous:
            return
        rate = (total - previous) / (taken_at - since)
        self.speed = rate if self.speed <= 0 else 0.7 * self.speed + 0.3 * rate
        if generated is not None and sample.generated_total is not None and sample.generated_total >= generated:
            grew = (sample.generated_total - generated) / (taken_at - since)
            self.growth = grew if self.growth <= 0 else 0.7 * self.growth + 0.3 * grew
        # How fast it works through a queue: only intervals it was full all along (at both pages a
        # queue, or its batch limit running: a backend the gateway keeps from queueing is full
        # there). `speed` follows the load it was given and so reads low after a quiet spell,
        # which would shed too much when a queue forms (in the gateway or the backend).
        if before is not None and self._full(sample) and self._full(before):
            self.drain = rate if self.drain <= 0 else 0.7 * self.drain + 0.3 * rate

    def _full(self, sample: Sample) -> bool:
        return sample.waiting > 0 or (self.limit > 0 and sample.running >= self.limit)

    def declare(self, limit: float) -> None:
        """The batch limit from the config (0: none): the limit from now on, until running above
        it raises it; a backend may still be learned from while none is declared."""
        if limit != self.declared:
            self.declared = self.limit = limit

    def _waits_for_slots(self, sample: Sample) -> bool:
        """Requests wait while the KV cache has room for the largest of this gateway's requests
        here (for 10% of the cache when it holds none or the capacity is unknown)."""
        if sample.waiting <= 0:
            return False
        free = 1.0 - sample.kv
        if self.capacity > 0 and self.leases:
            return free * self.capacity >= max(self.leases.values())
        return free >= 0.1

    def rebase(self, mark: int, in_flight_at: int | None) -> None:
        """A new sample (`self.sample`) reflecting the picks up to `mark`; `in_flight_at` requests
        were in flight when it was taken (None: as many as now).

        Picks since the page arrived are the newest leases above the count then. So are as many of
        the leases of then as the page does not show (running + waiting below the count): a request
        picked just before the page that had not reached the backend yet, or one that finished
        there and is not released here yet. Read as reflected, the first would free its slot and
        KV until the next page (a third request went to a backend with two slots); counted as new,
        the second comes off again as `gone` when it is released. Other gateways' requests in the
        page can hide ours (the count only ever raises the estimate)."""
        at = len(self.leases) if in_flight_at is None else in_flight_at
        sample = self.sample
        self.freed = 0.0  # this page's KV no longer counts what finished before it
        self._peer_news()
        shown = sample.running + sample.waiting if sample is not None else float(at)
        unseen = at - int(shown) if shown < at else 0
        # Every request the page should show, the peers' picked before it too: one it does not may have
        # finished before it was read (no KV credit then, `remove`).
        self.whole = unseen == 0 and shown >= at + self.peer_in_flight - self.peer_new
        extra = len(self.leases) - at + unseen
        if extra > 0:
            ordered = sorted(self.leases)
            self.mark = ordered[-extra] - 1
            self.new, self.gone, self.gone_tokens = extra, 0, 0
            self.new_tokens = sum(self.leases[seq] for seq in ordered[-extra:])
            self.new_outputs = sum(self.outputs.get(seq, 0) for seq in ordered[-extra:])
        else:
            # Which finished since the page is not known: no KV credit for them (conservative).
            self.mark, self.new, self.gone, self.new_tokens, self.gone_tokens = mark, 0, -extra, 0, 0
            self.new_outputs = 0
        self._hidden()  # against this page's new and gone
        self._count_steps()

    def _count_steps(self) -> None:
        """Credit the steps since the last page (`stepped`) to the requests that page showed
        running, and start counting for the ones this page shows (reflected, with nothing waiting:
        every request there is in the batch). A page with requests waiting credits nobody and stops
        every count (one may have been preempted, and resumed or not); the ends of the requests not
        credited move on with the count, so their steps left stay their output limit."""
        stepped, self.stepped = self.stepped, 0.0
        self.peak = len(self.leases)
        due, running = self.due, self.running
        sample = self.sample
        if sample is None or sample.waiting > 0:
            running.clear()
        if stepped > 0:
            self.steps += stepped
            if len(running) < len(due):
                for seq in due:
                    if seq not in running:
                        due[seq] += stepped
                leases = self.leases
                self.ends = sorted([*((end, leases[seq]) for seq, end in due.items()), *self.peer_ends])
        if sample is not None and sample.waiting <= 0 and len(running) < len(due):
            mark = self.mark
            running.update(seq for seq in due if seq <= mark)

    def set_peer(self, peer: PeerLoad | None, steps_at: float | None = None) -> None:
        """The other replicas' requests here now (None: none, or no shared view). Their counts and
        tokens join this replica's in `signals`; their picks after the sample count as new; those that
        said their output limit join `ends`, their steps left on this endpoint's step count."""
        ends = self.ends
        for entry in self.peer_ends:
            i = bisect_left(ends, entry)
            if i < len(ends) and ends[i] == entry:
                del ends[i]
        if peer is None:
            self.peer_in_flight = self.peer_committed = 0
            self.peer_picks = self.peer_ends = ()
        else:
            self.peer_in_flight, self.peer_committed = peer.in_flight, peer.committed
            self.peer_picks = tuple(peer.picks)
            steps = self.steps if steps_at is None else steps_at
            # A peer counts steps left to its own last page: one read after this replica's saw the
            # steps between the two go by, which this count has not credited yet (else its requests
            # would look closer to their end here than they are). One read before: kept as is (later).
            mine, rate = self.taken_at, self.step_rate
            known = rate > 0 and mine > float("-inf")
            self.peer_ends = tuple((steps + left + ((page_at - mine) * rate if known and page_at > mine else 0.0),
                                    tokens) for left, tokens, page_at in peer.ends)
            for entry in self.peer_ends:
                insort(ends, entry)
        self._peer_news()

    def _peer_news(self) -> None:
        """The peers' picks the sample cannot reflect yet: picked after it was taken."""
        taken = self.taken_at
        new = tokens = outputs = 0
        for at, cost, output in self.peer_picks:
            if at > taken:
                new += 1
                tokens += cost
                outputs += output
        self.peer_new, self.peer_new_tokens, self.peer_new_outputs = new, tokens, outputs
        self._hidden()

    def _hidden(self) -> None:
        """Requests of the pool picked before the sample that it does not show: sent just before the
        page was read and not arrived yet, one replica's hiding another's (each replica alone sees
        the page show as many as it sent). Counted as new, as this replica's own unseen ones are
        (`rebase`): else a peer's request on its way reads as a free slot. What this replica
        expects shown stays the same across its picks and releases (a pick adds to `new`, a
        release of a shown one to `gone`), so only a page or the peers change it."""
        sample = self.sample
        if sample is None or not self.peer_in_flight:
            self.peer_hidden = 0
            return
        expected = len(self.leases) - self.new + self.gone + self.peer_in_flight - self.peer_new
        self.peer_hidden = max(0, expected - int(sample.running + sample.waiting))

    def signals(self, now: float, stale_after: float) -> Signals:
        sample = self.sample
        # This replica's requests and, with a shared view, every other replica's (0 without).
        in_flight = len(self.leases) + self.peer_in_flight
        committed = self.committed + self.peer_committed
        new_tokens = self.new_tokens + self.peer_new_tokens
        new_outputs = self.new_outputs + self.peer_new_outputs
        ends = self.ends
        if sample is None or now - self.taken_at > stale_after:
            # Positional, in the declared order (see `Signals`): this runs per candidate per pick.
            return _build(Signals, (False, sample, 0.0, 0.0, 0.0, 0.0, 0, 0.0, 0.0,
                                    in_flight, committed, new_tokens, new_outputs, self.steps, ends,
                                    self.capacity, self.block, self.speed, self.growth, self.limit))
        waiting, running = correct(sample, self.new + self.peer_new + self.peer_hidden, self.gone)
        backlog = sample.waiting - self.gone if self.gone else sample.waiting
        return _build(Signals, (True, sample, waiting, running, sample.kv, backlog if backlog > 0 else 0.0,
                                self.gone_tokens, self.freed, now - self.taken_at,
                                in_flight, committed, new_tokens, new_outputs, self.steps, ends,
                                self.capacity, self.block, self.speed, self.growth, self.limit))
