"""Token leases: a replica reserves a block of a budget set's tokens in the shared (Redis) window and
admits that set's requests from it, with no Redis round trip on their path.

    book = LeaseBook(clock, lease_s=1.0, next_id=..., on_redis_error=..., on_settle_error=...)
    drawn = book.draw(budget_set, cost, want)                    # (lease, decision, taken), or None: a miss
    decisions, drawn = await book.reserve(window, budget_set, entry_id, cost, want)   # a miss: one round trip
    book.settle(lease, taken, amount)                            # a drawn request's end, exactly once
    book.retire_all(); await book.close()

A budget set is the tuple of (key, limit, window) a request is subject to; requests with the same set
draw from its one active lease. A lease is one entry in every window of its set, like a request's
reservation. Its `drawn` is its outstanding requests at their reservation plus its settled requests at
their actual, so a request settled below its estimate gives room back to the lease. While active, the
entry holds the grant (raised at once to `drawn` when usage above the estimates exceeds it); once retired
(after `lease_s`, replaced, or dropped on a Redis failure) the entry follows `drawn` exactly. The rules
and bounds are in README.md ("Token leases").

A request draws between `cost` (its least) and `want` (its output capped to the budget draws less than
it asked for). A set that counts a calendar period names the period in its keys, so a lease never
serves past its period: the first request of the next period has another set (and another lease).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any

from modeldock.admission.window import Decision, binding
from modeldock.budgets.redis_batch import CallLater, OnError, TimerHandle
from modeldock.budgets.redis_window import RedisTokenWindow
from modeldock.budgets.window import BudgetLimit
from modeldock.clock import Clock
from modeldock.redis_client import RedisUnavailable

log = logging.getLogger(__name__)

BudgetSet = tuple[BudgetLimit, ...]
Drawn = tuple["TokenLease", Decision, int]  # the lease, the binding decision, the tokens the request took

LEASE_SHARE = 16  # a lease takes at most 1/16 of the smallest limit of its set (at least one request)
HEADROOM = 2.0  # lease target: the set's recent draw over one lifetime, times this
PREFETCH = 0.5  # top up once the room falls under half the target, or past half the lifetime


class TokenLease:
    __slots__ = (
        "budget_set", "decision", "drawn", "entry", "folded", "grant", "granted_at", "id", "index", "keys",
        "outstanding", "periods", "retired", "timer", "topped", "window",
    )

    def __init__(
        self, lease_id: str, window: RedisTokenWindow, budget_set: BudgetSet, grant: int, decision: Decision,
        granted_at: float, index: int = 0,
    ) -> None:
        self.id = lease_id
        self.window = window  # the Redis that holds it
        self.budget_set = budget_set
        self.keys = [(key, length) for key, _, length in budget_set]
        self.grant = grant  # what Redis admitted
        self.entry = grant  # what its Redis entry holds now
        self.drawn = 0
        self.outstanding = 0  # drawn requests not yet settled
        self.decision = decision  # the binding decision at the grant (remaining after the whole grant)
        self.index = index  # which budget of the set it is
        self.periods = any(length < 0 for _, length in self.keys)  # counts a calendar period
        self.folded = False  # its final settlement was sent (a period's counter folds the entry)
        self.granted_at = granted_at  # local clock, taken before the call: never later than Redis's stamp
        self.retired = False
        self.timer: TimerHandle | None = None
        self.topped = False  # one top-up per lease

    @property
    def room(self) -> int:
        return self.grant - self.drawn


class _Set:
    __slots__ = ("active", "cap", "last", "pending", "rate")

    def __init__(self, cap: int, now: float) -> None:
        self.active: TokenLease | None = None
        self.pending = False  # a grant of a whole lease (a miss's or a top-up) is in flight
        self.cap = cap
        self.rate = 0.0  # tokens asked for over about the last lease lifetime (an exponentially decayed sum)
        self.last = now


class LeaseBook:
    def __init__(
        self,
        clock: Clock,
        lease_s: float,
        *,
        next_id: Callable[[], str],
        on_redis_error: OnError,
        on_settle_error: OnError,
        call_later: CallLater | None = None,
    ) -> None:
        self._clock = clock
        self.lease_s = lease_s  # 0: no leases, every request is reserved in Redis on its own
        self._next_id = next_id
        self._on_redis_error = on_redis_error  # a failed top-up (the set's lease is dropped)
        self._on_settle_error = on_settle_error
        self._call_later = call_later  # tests inject one; else the loop's
        self._sets: dict[BudgetSet, _Set] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._generation = 0  # bumped by retire_all: grants in flight from before are not installed
        # Plain counters (tests, benchmarks).
        self.draws = 0
        self.grants = 0
        self.top_ups = 0

    def draw(self, budget_set: BudgetSet, cost: int, want: int | None = None) -> Drawn | None:
        """The fast path: up to `want` (at least `cost`) from the set's active lease, no I/O. None: a miss
        (no lease, expired, too little room); the caller reserves in Redis (`reserve`)."""
        if self.lease_s <= 0:
            return None
        now = self._clock.monotonic()
        state = self._note(budget_set, cost, now)
        lease = state.active
        if lease is None:
            return None
        age = now - lease.granted_at
        if age >= self.lease_s:
            self._retire(lease)
            return None
        if lease.room < cost:
            return None
        taken = cost if want is None else min(max(want, cost), lease.room)
        lease.drawn += taken
        lease.outstanding += 1
        self.draws += 1
        if (
            not lease.topped
            and not state.pending
            and (lease.room < self._target(state, cost) * PREFETCH or age >= self.lease_s * PREFETCH)
        ):
            # So steady traffic never misses: the next lease is granted before this one runs out.
            lease.topped = state.pending = True
            self.top_ups += 1
            self._spawn(self._top_up(lease, state, cost))
        return lease, self._decision(lease, now), taken

    async def reserve(
        self, window: RedisTokenWindow, budget_set: BudgetSet, entry_id: str, cost: int, want: int | None = None
    ) -> tuple[list[Decision], Drawn | None]:
        """A miss: one reserve-up-to in Redis with `cost` as the minimum and the set's lease target (at least
        the request's `want`) as the want; the grant becomes the set's active lease (the old one retires)
        and the request draws up to `want` from it.
        Redis's decisions, and (lease, decision) when admitted. RedisUnavailable: the set's lease is dropped
        and the call undone in Redis (it may have counted).

        One whole lease in flight per set: a miss meanwhile reserves just its cost (a lease of one request),
        so a burst of misses cannot take a lease each."""
        asked = cost if want is None else max(want, cost)
        state = self._sets.get(budget_set) if self.lease_s > 0 else None
        whole = state is not None and not state.pending
        target = max(self._target(state, cost), asked) if state is not None and whole else asked
        generation = self._generation
        if state is not None and whole:
            state.pending = True
        try:
            decisions, lease = await self._grant(window, budget_set, entry_id, cost, target)
        finally:
            if state is not None and whole:
                state.pending = False
        if lease is None:
            return decisions, None
        taken = min(asked, lease.grant)
        lease.drawn, lease.outstanding = taken, 1
        self._install(lease, generation)
        return decisions, (lease, self._decision(lease, self._clock.monotonic()), taken)

    def settle(self, lease: TokenLease, cost: int, amount: int) -> asyncio.Future[None] | None:
        """A request drawn from `lease` ends at `amount` (reserved `cost`): the lease's room changes by the
        difference; Redis is written only when its entry must follow (see the module docstring)."""
        lease.drawn += amount - cost
        lease.outstanding -= 1
        return self._sync(lease)

    def drop(self, budget_set: BudgetSet) -> None:
        """After a Redis failure: the set's next request takes the exact path (and its failure rule)."""
        state = self._sets.get(budget_set)
        if state is not None and state.active is not None:
            self._retire(state.active)

    def retire_all(self) -> None:
        """Every active lease retires (reconfigure, close); grants in flight are retired on arrival."""
        self._generation += 1
        for state in self._sets.values():
            if state.active is not None:
                self._retire(state.active)
        self._sets.clear()

    def held(self) -> int:
        """Tokens the active leases hold undrawn (tests, shutdown checks)."""
        return sum(max(s.active.room, 0) for s in self._sets.values() if s.active is not None)

    async def wait(self) -> None:
        """Until the top-ups in flight have their answer (flush, tests)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def close(self) -> None:
        """Stop top-ups (one cut mid-call is undone in Redis) and retire every lease; the caller then
        flushes the windows."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.retire_all()

    async def _grant(
        self, window: RedisTokenWindow, budget_set: BudgetSet, lease_id: str, cost: int, want: int
    ) -> tuple[list[Decision], TokenLease | None]:
        started = self._clock.monotonic()
        try:
            decisions, grant = await window.reserve_up_to(lease_id, cost, want, budget_set)
        except BaseException as exc:
            # A call that timed out or was cancelled may still have counted: undo it, best effort.
            window.settle_later(lease_id, [(key, length) for key, _, length in budget_set], 0, _ignore)
            if isinstance(exc, RedisUnavailable):
                self.drop(budget_set)
            raise
        if not decisions[0].allowed:  # all or nothing: one decision tells
            return decisions, None
        self.grants += 1
        index = binding(decisions)
        return decisions, TokenLease(lease_id, window, budget_set, grant, decisions[index], started, index)

    def _install(self, lease: TokenLease, generation: int) -> None:
        state = self._sets.get(lease.budget_set)
        if state is None or generation != self._generation or lease.room <= 0:
            # Leases off, made before a reconfigure, or no room left: it settles like one request.
            self._retire(lease)
            return
        if state.active is not None:
            self._retire(state.active)
        state.active = lease
        later = self._call_later or asyncio.get_running_loop().call_later
        # Retires an idle lease, so a replica that stops sending does not hold its room for the window.
        lease.timer = later(self.lease_s, lambda: self._expire(lease))

    async def _top_up(self, old: TokenLease, state: _Set, cost: int) -> None:
        generation = self._generation
        try:
            _, lease = await self._grant(old.window, old.budget_set, self._next_id(), cost, self._target(state, cost))
        except RedisUnavailable as exc:
            self._on_redis_error(exc)
            return
        finally:
            state.pending = False
        if lease is not None:  # refused: this lease serves on; its end is a miss
            self._install(lease, generation)

    def _expire(self, lease: TokenLease) -> None:
        lease.timer = None
        self._retire(lease)
        state = self._sets.get(lease.budget_set)
        if state is not None and state.active is None and self._clock.monotonic() - state.last >= self.lease_s:
            del self._sets[lease.budget_set]  # idle: forget its rate

    def _retire(self, lease: TokenLease) -> None:
        if lease.retired:
            return
        lease.retired = True
        if lease.timer is not None:
            lease.timer.cancel()
            lease.timer = None
        state = self._sets.get(lease.budget_set)
        if state is not None and state.active is lease:
            state.active = None
        self._sync(lease)  # frees the undrawn part at once

    def _sync(self, lease: TokenLease) -> asyncio.Future[None] | None:
        drawn = lease.drawn
        if not lease.retired:
            if drawn <= lease.entry:
                return None  # active: the difference is room, Redis already holds it
        elif lease.periods and not lease.outstanding and not lease.folded:
            # Its last write: a period's counter folds the entry into its total (memory: only live entries).
            lease.folded, lease.entry = True, drawn
            return lease.window.settle_later(lease.id, lease.keys, drawn, self._on_settle_error, final=True)
        elif drawn == lease.entry or (drawn == 0 and lease.outstanding):
            return None  # 0 would remove the entry while a request may still settle into it
        lease.entry = drawn
        return lease.window.settle_later(lease.id, lease.keys, drawn, self._on_settle_error)

    def _note(self, budget_set: BudgetSet, cost: int, now: float) -> _Set:
        state = self._sets.get(budget_set)
        if state is None:
            state = self._sets[budget_set] = _Set(min(limit for _, limit, _ in budget_set) // LEASE_SHARE, now)
        state.rate = state.rate * math.exp((state.last - now) / self.lease_s) + cost
        state.last = now
        return state

    @staticmethod
    def _target(state: _Set, cost: int) -> int:
        return max(cost, min(int(state.rate * HEADROOM), state.cap))

    def _decision(self, lease: TokenLease, now: float) -> Decision:
        # Remaining as Redis saw it after the grant, plus what the lease still holds for this replica.
        d = lease.decision
        return Decision(
            allowed=True,
            limit=d.limit,
            remaining=d.remaining + max(lease.room, 0),
            reset_after_s=max(d.reset_after_s - (now - lease.granted_at), 0.0),
            retry_after_s=0.0,
            at=now,
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("token lease top-up failed", exc_info=task.exception())


def _ignore(_exc: RedisUnavailable) -> None:
    pass
