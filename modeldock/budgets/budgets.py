"""Token and cost budgets: reserve a request's estimate at admission (its output capped to what fits),
settle once at the end.

    budgets = TokenBudgets(config, clock)
    reservation = await budgets.reserve(tenant, served_model, request_id=rid, prompt=p, output=o,
                                        min_output=m)                  # RateLimited / Unavailable
    reservation.output                     # the output limit to write into the body (m <= output <= o)
    response_headers.update(reservation.headers)                       # x-ratelimit-*, binding budget
    ...
    reservation.finish_nowait(sent=..., usage=..., backend_error=...)  # exactly once; later calls no-op

The windows, calendar periods, the Redis layout, token leases (lease.py: with Redis, requests are
admitted from a block reserved there, without a round trip each) and the settlement rule are in
README.md ("Token budgets").
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, overload

from modeldock.admission.headers import format_duration
from modeldock.admission.window import Decision, binding
from modeldock.budgets.headers import budget_headers, format_money
from modeldock.budgets.lease import BudgetSet, Drawn, LeaseBook
from modeldock.budgets.period import Periods
from modeldock.budgets.pricing import Price
from modeldock.budgets.redis_batch import CallLater
from modeldock.budgets.redis_window import RedisTokenWindow
from modeldock.budgets.reservation import Reservation, ReservationState
from modeldock.budgets.specs import (
    Plan,
    Spec,
    binding_index,
    budget_specs,
    has_budgets,
    matching_budgets,
    shapes_for,
    with_period_times,
)
from modeldock.budgets.tokens import Usage
from modeldock.budgets.window import Shape, TokenWindow, shaped
from modeldock.clock import Clock
from modeldock.config import Config, LimitsConfig, TenantConfig
from modeldock.errors import RateLimited, limiter_unavailable
from modeldock.redis_client import LogThrottle, RedisClientFactory, RedisUnavailable, make_client_factory
from modeldock.redis_metrics import RedisMetrics

__all__ = ["Reservation", "ReservationState", "TokenBudgets", "has_budgets", "matching_budgets"]

log = logging.getLogger(__name__)

MINUTE_SECONDS = 60.0

class TokenBudgets:
    def __init__(
        self,
        config: Config,
        clock: Clock,
        redis_client_factory: RedisClientFactory | None = None,  # None: the batch client, per limits.redis_cluster
        *,
        minute_seconds: float = MINUTE_SECONDS,
        redis_now_us: Callable[[], int] | None = None,
        redis_call_later: CallLater | None = None,
        warn_interval_s: float = 10.0,
        redis_metrics: RedisMetrics | None = None,
    ) -> None:
        self._redis_metrics = redis_metrics
        self._clock = clock
        self._redis_client_factory = redis_client_factory
        self._minute = minute_seconds
        self._periods = Periods()
        self._plans: dict[tuple[str, str, Price | None], tuple[TenantConfig, Plan | None]] = {}
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

    @overload
    async def reserve(
        self, tenant: TenantConfig, model: str, request_id: str, /, *, prompt: int, output: int,
        min_output: int | None = None, price: Price | None = None,
    ) -> Reservation: ...

    @overload
    async def reserve(self, tenant: TenantConfig, model: str, cost: int, request_id: str, /) -> Reservation: ...

    async def reserve(
        self, tenant: TenantConfig, model: str, first: int | str, second: str | None = None, /, *,
        prompt: int | None = None, output: int = 0, min_output: int | None = None, price: Price | None = None,
    ) -> Reservation:
        """Reserve the request's prompt estimate and output limit in every budget it is subject to, or raise.

        `model` is the served name. With `prompt`/`output`: when every budget has room for prompt + output,
        that is reserved; when one has room only for less and `limits.cap_output_to_budget` is on, the
        output is capped to the most that fits all (at least `min_output`, default `output`: no capping);
        `reservation.output` is the limit to forward. The older form passes one `cost` (reserved whole,
        never capped). `price`: the model's own (`models[].price`), as the director passes it; None: no
        cost budget counts. A second call with the same `request_id` while the first is held returns it.
        Raises RateLimited (429) or Unavailable (503); nothing is held when it raises.
        """
        # reserve(tenant, model, request_id, prompt=..., output=...) or the older reserve(tenant, model, cost, id)
        request_id, cost = (first, 0) if isinstance(first, str) else (second, first)
        if request_id is None:
            raise TypeError("reserve() needs a request_id")
        existing = self._held.get(request_id)
        if existing is not None:
            return existing
        if prompt is None:
            prompt, output, least = max(cost, 0), 0, 0
        else:
            prompt, output = max(prompt, 0), max(output, 0)
            least = output if min_output is None or not self._limits.cap_output_to_budget else (
                min(max(min_output, 0), output))
        plan = self._plan(tenant, model, price)
        if plan is None:
            return Reservation(None, request_id, "", prompt, output, [], None, {}, price=price)
        specs, limits, keys = plan.specs, plan.limits, plan.keys
        shapes = shapes_for(specs, prompt, price)  # cheap: one tuple per budget
        if plan.costed or prompt + least > plan.least_limit:
            for spec, shape in zip(specs, shapes, strict=True):
                need = shaped(shape, least)
                if need > spec.limit[1]:
                    self.decisions["too_large"] += 1
                    raise RateLimited(
                        f"Request too large for {spec.label}: limit {_amount(spec, spec.limit[1])}, requested "
                        f"{_amount(spec, need)}. Reduce the prompt or max_tokens (max_completion_tokens).",
                        code="tokens_request_too_large",
                    )
        entry_id = self._next_id()
        if plan.costed:
            local, grant = self._local.try_reserve_up_to(entry_id, least, output, limits, shapes)
        else:  # token budgets only: one amount in every window, prompt + output
            local, total = self._local.try_reserve_up_to(entry_id, prompt + least, prompt + output, limits)
            grant = total - prompt
        if not local[0].allowed:
            raise self._refused(specs, local, shapes, least)
        headers = self._headers(plan, local, shapes, grant)
        lease, taken = None, None
        redis = self._redis
        if redis is not None:
            shared = await self._reserve_shared(redis, plan, entry_id, shapes, least, grant, prompt)
            if shared is not None:
                shared_grant, lease, shared_headers = shared
                if shared_grant < grant:  # Redis had room for less: the local window follows
                    self._local.settle(entry_id, keys, [shaped(f, shared_grant) for f in shapes], final=False)
                grant, headers = shared_grant, shared_headers
                taken = prompt + grant if lease is not None else None
        self.decisions["admitted"] += 1
        reservation = Reservation(self, request_id, entry_id, prompt, grant, keys, lease, headers, asked=output,
                                  units=plan.units, price=price, taken=taken)
        self._held[request_id] = reservation
        return reservation

    def _plan(self, tenant: TenantConfig, model: str, price: Price | None) -> Plan | None:
        """The request's budgets (None: none apply), remembered per (tenant, model, price) until the
        first of its periods ends."""
        now = self._clock.time()
        key = (tenant.id, model, price)
        cached = self._plans.get(key)
        if cached is not None and cached[0] is tenant and (cached[1] is None or now < cached[1].until):
            return cached[1]
        specs = budget_specs(tenant, model, now, self._periods, self._limits.budget_timezone, price,
                             minute_s=self._minute)
        if len(self._plans) >= 4096:
            self._plans.clear()
        plan = Plan.of(specs) if specs else None
        self._plans[key] = (tenant, plan)
        return plan

    async def _reserve_shared(
        self, redis: RedisTokenWindow, plan: Plan, entry_id: str, shapes: list[Shape], least: int, want: int,
        prompt: int,
    ) -> tuple[int, Any, dict[str, str]] | None:
        """Redis decides: (the output granted, the lease drawn from or None, the headers), or 429 / 503.
        None: failed open (the local reservation stands). Token budgets draw from leases (in tokens);
        a set with a cost budget is reserved per request."""
        specs, limits, keys, costed = plan.specs, plan.limits, plan.keys, plan.costed
        budget_set: BudgetSet = tuple(limits)
        try:
            if costed:
                try:
                    decisions, grant = await redis.reserve_up_to(entry_id, least, want, limits, shapes)
                except BaseException:
                    redis.settle_later(entry_id, keys, 0, _ignore)  # it may have counted: undo, best effort
                    raise
                if not decisions[0].allowed:
                    self._local.settle(entry_id, keys, 0)
                    raise self._refused(specs, decisions, shapes, least)
                return grant, None, self._headers(plan, decisions, shapes, grant)
            drawn: Drawn | None = self._leases.draw(budget_set, prompt + least, prompt + want)
            if drawn is None:
                decided, drawn = await self._leases.reserve(redis, budget_set, entry_id, prompt + least,
                                                            prompt + want)
                if drawn is None:
                    self._local.settle(entry_id, keys, 0)
                    raise self._refused(specs, decided, shapes, least)
            lease, decision, taken = drawn
            spec = specs[lease.index]
            if spec.ends_at:
                decision = with_period_times([spec], [decision], self._clock.time())[0]
            return taken - prompt, lease, budget_headers([(spec.field, False, decision)], 0)
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
        except RateLimited:
            raise
        except BaseException:
            self._local.settle(entry_id, keys, 0)
            raise

    def _headers(
        self, plan: Plan, decisions: Sequence[Decision], shapes: Sequence[Shape], grant: int
    ) -> dict[str, str]:
        specs = plan.specs
        timed = with_period_times(specs, decisions, self._clock.time()) if plan.periods else decisions
        # Token budgets only: the fewest tokens left binds (binding_index's order, without the arithmetic).
        bound = binding_index(timed, shapes, grant) if plan.costed else binding(timed)
        return budget_headers([(s.field, s.unit == "cost", d) for s, d in zip(specs, timed, strict=True)], bound)

    def _refused(
        self, specs: Sequence[Spec], decisions: Sequence[Decision], shapes: Sequence[Shape], least: int
    ) -> RateLimited:
        needs = [shaped(shape, least) for shape in shapes]
        timed = with_period_times(specs, decisions, self._clock.time(), needs)
        index = binding_index(timed, shapes, least)
        spec, decision = specs[index], timed[index]
        self.decisions["rate_limited"] += 1
        used = decision.limit - decision.remaining
        return RateLimited(
            f"Rate limit reached for {spec.label}: limit {_amount(spec, decision.limit)}, used "
            f"{_amount(spec, used)}, requested {_amount(spec, shaped(shapes[index], least))}. "
            f"Try again in {format_duration(decision.retry_after_s)}.",
            code="tokens_rate_limited",
            headers=budget_headers([(s.field, s.unit == "cost", d) for s, d in zip(specs, timed, strict=True)],
                                   index, rejected=True),
        )

    def reconfigure(self, config: Config) -> None:
        """New limits apply from the next reservation; held reservations settle where they were made."""
        old, new = self._limits, config.limits
        self._limits = new
        self._plans.clear()
        # Leases belong to a window and a budget set: new ones are made from the next request on.
        self._leases.retire_all()
        self._leases.lease_s = new.token_lease_ms / 1000
        if (old.redis_url, old.redis_timeout_ms, old.redis_cluster, old.redis_auth) != (
                new.redis_url, new.redis_timeout_ms, new.redis_cluster, new.redis_auth):
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

    def _settle(self, reservation: Reservation, usage: Usage) -> asyncio.Future[None] | None:
        self._held.pop(reservation.request_id, None)
        amounts = reservation.amounts(usage)
        self._local.settle(reservation._entry_id, reservation._keys, amounts)
        lease = reservation._lease
        if lease is not None:
            # Any Redis write is queued in the window that holds the lease; a cancelled caller does not cut it.
            return self._leases.settle(lease, reservation._taken, max(usage.total, 0))
        redis = self._redis
        if redis is not None and any(reservation._units):  # a cost set, reserved per request
            return redis.settle_later(reservation._entry_id, reservation._keys, amounts, self._settle_failed,
                                      final=True)
        return None

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
        factory = self._redis_client_factory or make_client_factory(batch=True, cluster=limits.redis_cluster,
                                                                    auth=limits.redis_auth)
        return RedisTokenWindow(
            lambda: factory(url, timeout_s),
            timeout_s=timeout_s,
            now_us=self._redis_now_us,
            call_later=self._redis_call_later,
            metrics=self._redis_metrics,
        )


def _amount(spec: Spec, value: int) -> str:
    return format_money(value) if spec.unit == "cost" else str(value)


def _ignore(_exc: RedisUnavailable) -> None:
    pass
