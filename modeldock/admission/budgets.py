"""Token budgets: reserve a request's estimated tokens at admission, settle once at the end.

    budgets = TokenBudgets(config, clock)
    reservation = await budgets.reserve(tenant, served_model, cost, request_id)  # RateLimited / Unavailable
    response_headers.update(reservation.headers)                                  # x-ratelimit-*-tokens
    ...
    await reservation.finish(reached_backend=..., usage=...)                      # exactly once; later calls no-op

The windows, the Redis layout, token leases (budget_lease.py: with Redis, requests are admitted from a
block reserved there, without a round trip each) and the settlement rule are in README.md ("Token budgets").
"""

from __future__ import annotations

import asyncio
import fnmatch
import itertools
import logging
import os
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Literal

from redis.asyncio import Redis

from modeldock.admission.budget_headers import token_ratelimit_headers, token_rejection_headers
from modeldock.admission.budget_lease import BudgetSet, Drawn, Lease, LeaseBook
from modeldock.admission.budget_redis import RedisTokenWindow, budget_key
from modeldock.admission.budget_window import BudgetLimit, TokenWindow
from modeldock.admission.headers import format_duration
from modeldock.admission.limits import LogThrottle
from modeldock.admission.redis_batch import CallLater, make_batch_client
from modeldock.admission.redis_window import RedisUnavailable
from modeldock.admission.tokens import Usage
from modeldock.admission.window import Decision, binding
from modeldock.clock import Clock
from modeldock.config import Config, LimitsConfig, TenantConfig
from modeldock.errors import RateLimited, limiter_unavailable

log = logging.getLogger(__name__)

MINUTE_SECONDS = 60.0
DAY_SECONDS = 86_400.0

RedisClientFactory = Callable[[str, float], Redis]
State = Literal["held", "settled", "refunded", "charged"]


def matching_budgets(per_model: Mapping[str, int], model: str) -> list[tuple[str, int]]:
    """Every (pattern, limit) whose glob matches `model` (the served name), in pattern order.

    Each pattern is one budget shared by all the models it matches, and every
    matching pattern applies (like the tenant budget applies beside them).
    """
    return sorted((p, limit) for p, limit in per_model.items() if limit > 0 and fnmatch.fnmatchcase(model, p))


def has_budgets(tenant: TenantConfig) -> bool:
    """Whether any token budget is set for the tenant (a cheap check for the request path)."""
    return bool(tenant.tokens_per_minute or tenant.tokens_per_day or tenant.tokens_per_minute_per_model)


class Reservation:
    """One request's tokens, held from admission until `finish` (or settle/refund/charge_reserved).

    The first of those calls decides; every later call is a no-op, so the
    end-of-stream path, an error path and a retry report may all call it.
    """

    __slots__ = ("_budgets", "_entry_id", "_keys", "_lease", "request_id", "cost", "headers", "state", "charged")

    def __init__(
        self,
        budgets: TokenBudgets | None,
        request_id: str,
        entry_id: str,
        cost: int,
        keys: list[tuple[str, float]],
        lease: Lease | None,
        headers: Mapping[str, str],
    ) -> None:
        self._budgets = budgets
        self._entry_id = entry_id
        self._keys = keys
        self._lease = lease  # the shared (Redis) lease it was drawn from, if any
        self.request_id = request_id
        self.cost = cost
        self.headers: Mapping[str, str] = headers
        self.state: State = "held"
        self.charged: int | None = None  # tokens finally counted, once settled

    @property
    def done(self) -> bool:
        return self.state != "held"

    @property
    def counted(self) -> bool:
        """False when no budget applies to the request (nothing was reserved, nothing to settle)."""
        return self._budgets is not None

    async def finish(self, *, reached_backend: bool, usage: Usage | None) -> None:
        """The settlement rule, in one place:

        - never reached a backend (rejected later, no endpoint, every attempt failed
          before a response): refund, 0 tokens;
        - the backend reported usage: charge exactly `usage.total` (lower or higher
          than the reservation);
        - reached a backend but usage is unknown (client gone mid-stream, stream cut,
          backend sent none): charge the reservation, which is the request's ceiling.
        """
        await self._wait(self.finish_nowait(reached_backend=reached_backend, usage=usage))

    def finish_nowait(self, *, reached_backend: bool, usage: Usage | None) -> asyncio.Future[None] | None:
        """`finish` without waiting: the local windows change now, a shared (Redis) settlement is queued
        for the window's next flush (the returned future is done once Redis took it or it failed;
        `close` flushes). For callers off the request path (settlement from Envoy's access log) and
        for refunds in an error path."""
        if not reached_backend:
            return self._close_nowait("refunded", 0)
        if usage is None:
            return self._close_nowait("charged", self.cost)
        return self._close_nowait("settled", max(usage.total, 0))

    async def settle(self, total: int) -> None:
        await self._wait(self._close_nowait("settled", max(total, 0)))

    async def refund(self) -> None:
        await self._wait(self._close_nowait("refunded", 0))

    def refund_nowait(self) -> None:
        self._close_nowait("refunded", 0)

    async def charge_reserved(self) -> None:
        await self._wait(self._close_nowait("charged", self.cost))

    def _close_nowait(self, state: State, amount: int) -> asyncio.Future[None] | None:
        if self.state != "held":
            return None
        # Decided before any await, so concurrent callers cannot both settle.
        self.state = state
        self.charged = amount
        if self._budgets is None:
            return None
        return self._budgets._settle(self, amount)

    @staticmethod
    async def _wait(done: asyncio.Future[None] | None) -> None:
        if done is not None:
            # Shielded: a caller cancelled mid-call (its stream ended) does not cut the settlement.
            await asyncio.shield(done)


class TokenBudgets:
    def __init__(
        self,
        config: Config,
        clock: Clock,
        redis_client_factory: RedisClientFactory = make_batch_client,
        *,
        minute_seconds: float = MINUTE_SECONDS,
        day_seconds: float = DAY_SECONDS,
        redis_now_us: Callable[[], int] | None = None,
        redis_call_later: CallLater | None = None,
        warn_interval_s: float = 10.0,
    ) -> None:
        self._clock = clock
        self._redis_client_factory = redis_client_factory
        self._minute = minute_seconds
        self._day = day_seconds
        self._redis_now_us = redis_now_us  # tests only: replaces Redis's TIME
        self._redis_call_later = redis_call_later  # tests only: fires the settlement flush and lease timers
        self._local = TokenWindow(clock)
        self._limits = config.limits
        self._redis = self._make_redis(config.limits)
        self._held: dict[str, Reservation] = {}
        self._retired: list[RedisTokenWindow] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._tag = os.urandom(6).hex()
        self._ids = itertools.count()
        self._warn = LogThrottle(clock, warn_interval_s)
        self._leases = LeaseBook(
            clock,
            config.limits.token_lease_ms / 1000,
            next_id=self._next_id,
            on_redis_error=self._top_up_failed,
            on_settle_error=self._settle_failed,
            call_later=redis_call_later,
        )
        # Plain counters; the caller may export them.
        self.decisions: dict[str, int] = {"admitted": 0, "rate_limited": 0, "too_large": 0, "unavailable": 0}
        self.redis_errors = 0
        self.fail_open_passes = 0
        self.settle_errors = 0

    def held(self, request_id: str) -> Reservation | None:
        return self._held.get(request_id)

    async def reserve(self, tenant: TenantConfig, model: str, cost: int, request_id: str) -> Reservation:
        """Reserve `cost` tokens in every budget the request is subject to, or raise.

        `model` is the served name (what reaches the backend). A second call with
        the same `request_id` while the first reservation is held returns it (a
        reservation belongs to the request, not to an attempt). Raises
        RateLimited (429) or Unavailable (503); nothing is held when it raises.
        """
        existing = self._held.get(request_id)
        if existing is not None:
            return existing
        limits, labels = self._budgets(tenant, model)
        if not limits:
            return Reservation(None, request_id, "", cost, [], None, {})
        cost = max(cost, 0)
        for (_, limit, _w), label in zip(limits, labels, strict=True):
            if cost > limit:
                self.decisions["too_large"] += 1
                raise RateLimited(
                    f"Request too large for {label}: limit {limit}, requested {cost}. "
                    "Reduce the prompt or max_tokens (max_completion_tokens).",
                    code="tokens_request_too_large",
                )
        entry_id = self._next_id()
        keys = [(key, window) for key, _, window in limits]
        local = self._local.try_reserve_all(entry_id, cost, limits)
        index = binding(local)
        if not local[index].allowed:
            raise self._rate_limited(labels[index], local[index], cost)
        decision, lease = local[index], None
        redis = self._redis
        if redis is not None:
            budget_set = tuple(limits)
            # From the set's lease when it has room (no I/O), else one round trip that grants a new one.
            drawn = self._leases.draw(budget_set, cost) or await self._reserve_shared(
                redis, budget_set, entry_id, keys, labels, cost
            )
            if drawn is not None:
                lease, decision = drawn
        self.decisions["admitted"] += 1
        reservation = Reservation(self, request_id, entry_id, cost, keys, lease, token_ratelimit_headers(decision))
        self._held[request_id] = reservation
        return reservation

    async def _reserve_shared(
        self,
        redis: RedisTokenWindow,
        budget_set: BudgetSet,
        entry_id: str,
        keys: list[tuple[str, float]],
        labels: list[str],
        cost: int,
    ) -> Drawn | None:
        """A lease miss: Redis decides (429, or 503 / a local pass when it fails). None: failed open."""
        try:
            shared, drawn = await self._leases.reserve(redis, budget_set, entry_id, cost)
        except RedisUnavailable as exc:
            self.redis_errors += 1
            if not self._limits.redis_fail_open:
                self._local.settle(entry_id, keys, 0)
                self.decisions["unavailable"] += 1
                if self._warn.ready():
                    log.warning("Redis token budgets failed (%s); rejecting requests with 503", exc)
                raise limiter_unavailable() from None
            self.fail_open_passes += 1
            if self._warn.ready():
                log.warning("Redis token budgets failed (%s); admitting on local budgets (fail open)", exc)
            return None
        except BaseException:
            self._local.settle(entry_id, keys, 0)
            raise
        if drawn is None:
            self._local.settle(entry_id, keys, 0)
            index = binding(shared)
            raise self._rate_limited(labels[index], shared[index], cost)
        return drawn

    def reconfigure(self, config: Config) -> None:
        """New limits apply from the next reservation; held reservations settle where they were made."""
        old, new = self._limits, config.limits
        self._limits = new
        # Leases belong to a window and a budget set: new ones are made from the next request on.
        self._leases.retire_all()
        self._leases.lease_s = new.token_lease_ms / 1000
        if (old.redis_url, old.redis_timeout_ms) != (new.redis_url, new.redis_timeout_ms):
            retired, self._redis = self._redis, self._make_redis(new)
            if retired is not None:
                self._retired.append(retired)
                self._spawn(self._close_later(retired))

    async def flush(self) -> None:
        """Wait for lease top-ups in flight, then send the queued Redis settlements now and wait for them
        (shutdown, tests)."""
        await self._leases.wait()
        for window in [*self._retired, *([self._redis] if self._redis else [])]:
            await window.batch.flush()

    async def close(self) -> None:
        """Flush queued settlements to every Redis that holds them (each bounded by its timeout), then
        close the clients."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._leases.close()  # their settlements are queued in the windows flushed below
        windows = [*self._retired, *([self._redis] if self._redis else [])]
        self._retired.clear()
        self._redis = None
        await asyncio.gather(*(window.close() for window in windows))

    def _settle(self, reservation: Reservation, amount: int) -> asyncio.Future[None] | None:
        self._held.pop(reservation.request_id, None)
        self._local.settle(reservation._entry_id, reservation._keys, amount)
        lease = reservation._lease
        if lease is None:
            return None
        # Any Redis write is queued in the window that holds the lease; a cancelled caller does not cut it.
        return self._leases.settle(lease, reservation.cost, amount)

    def held_count(self) -> int:
        """Reservations not yet settled (for tests and shutdown checks)."""
        return len(self._held)

    def _settle_failed(self, exc: RedisUnavailable) -> None:
        # The shared windows keep the entry's amount: the requests are charged their estimates.
        self.settle_errors += 1
        if self._warn.ready():
            log.warning("Redis token settlement failed (%s); the reservation stands as charged", exc)

    def _top_up_failed(self, exc: RedisUnavailable) -> None:
        self.redis_errors += 1
        if self._warn.ready():
            log.warning("Redis token lease top-up failed (%s); the next request reserves in Redis", exc)

    def _next_id(self) -> str:
        return f"{self._tag}:{next(self._ids):x}"

    def _budgets(self, tenant: TenantConfig, model: str) -> tuple[list[BudgetLimit], list[str]]:
        limits: list[BudgetLimit] = []
        labels: list[str] = []
        if tenant.tokens_per_minute > 0:
            limits.append((budget_key(tenant.id, "minute"), tenant.tokens_per_minute, self._minute))
            labels.append(f"tokens per minute for tenant {tenant.id}")
        if tenant.tokens_per_day > 0:
            limits.append((budget_key(tenant.id, "day"), tenant.tokens_per_day, self._day))
            labels.append(f"tokens per day for tenant {tenant.id}")
        for pattern, limit in matching_budgets(tenant.tokens_per_minute_per_model, model):
            limits.append((budget_key(tenant.id, f"minute:model:{pattern}"), limit, self._minute))
            labels.append(f"tokens per minute for tenant {tenant.id} on models {pattern}")
        return limits, labels

    def _rate_limited(self, label: str, decision: Decision, cost: int) -> RateLimited:
        self.decisions["rate_limited"] += 1
        used = decision.limit - decision.remaining
        return RateLimited(
            f"Rate limit reached for {label}: limit {decision.limit}, used {used}, requested {cost}. "
            f"Try again in {format_duration(decision.retry_after_s)}.",
            code="tokens_rate_limited",
            headers=token_rejection_headers(decision),
        )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:
            coro.close()
            return None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _close_later(self, window: RedisTokenWindow) -> None:
        await asyncio.sleep(window.timeout_s * 2 + 0.1)
        self._retired.remove(window)
        await asyncio.shield(window.close())

    def _make_redis(self, limits: LimitsConfig) -> RedisTokenWindow | None:
        if limits.redis_url is None:
            return None
        url, timeout_s = limits.redis_url, limits.redis_timeout_ms / 1000
        return RedisTokenWindow(
            lambda: self._redis_client_factory(url, timeout_s),
            timeout_s=timeout_s,
            now_us=self._redis_now_us,
            call_later=self._redis_call_later,
        )
