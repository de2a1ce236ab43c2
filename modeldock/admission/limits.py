"""The one entry point the ext_proc uses for rate and concurrency limits.

Order of checks for a request, each undone if a later one rejects:
  1. in-flight slot for the tenant (this replica);
  2. local sliding windows (this replica; cheap, rejects without a Redis call);
  3. Redis sliding windows (all replicas; the global truth) when `limits.redis_url` is set.
See README.md in this package for the semantics and failure modes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from types import TracebackType

from prometheus_client import CollectorRegistry

from modeldock.admission.concurrency import ConcurrencyLimiter, Slot
from modeldock.admission.headers import format_duration, ratelimit_headers, rejection_headers
from modeldock.admission.metrics import AdmissionMetrics
from modeldock.admission.per_model import PerModelLimits
from modeldock.admission.redis_window import RedisWindow, model_key, tenant_key
from modeldock.admission.window import WINDOW_SECONDS, Decision, SlidingWindow, binding
from modeldock.clock import Clock
from modeldock.config import Config, LimitsConfig, TenantConfig
from modeldock.errors import RateLimited, limiter_unavailable
from modeldock.redis_client import LogThrottle, RedisClientFactory, RedisUnavailable, make_client_factory
from modeldock.redis_metrics import RedisMetrics

log = logging.getLogger(__name__)


class Ticket:
    """An admitted request. Call `release()` when its HTTP stream ends, however it ends."""

    __slots__ = ("_slot", "headers")

    def __init__(self, slot: Slot, headers: Mapping[str, str]) -> None:
        self._slot = slot
        self.headers: Mapping[str, str] = headers  # x-ratelimit-* for the response; may be empty

    @property
    def released(self) -> bool:
        return self._slot.released

    def release(self) -> None:
        """Free the in-flight slot. Safe to call more than once."""
        self._slot.release()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


class Admission:
    def __init__(
        self,
        config: Config,
        clock: Clock,
        redis_client_factory: RedisClientFactory | None = None,  # None: make_redis_client, per limits.redis_cluster
        *,
        registry: CollectorRegistry | None = None,
        window_seconds: float = WINDOW_SECONDS,
        warn_interval_s: float = 10.0,
        redis_metrics: RedisMetrics | None = None,
    ) -> None:
        self._redis_metrics = redis_metrics
        self._clock = clock
        self._redis_client_factory = redis_client_factory
        self._window_seconds = window_seconds
        self._local = SlidingWindow(clock, window_seconds)
        self._concurrency = ConcurrencyLimiter()
        self.metrics = AdmissionMetrics(registry)
        self.metrics.track_in_flight(self._concurrency.total)
        self._fail_open_log = LogThrottle(clock, warn_interval_s)
        self._fail_closed_log = LogThrottle(clock, warn_interval_s)
        self._limits = config.limits
        self._per_model = PerModelLimits(config)
        self._redis = self._make_redis(config.limits)
        self._retired: list[RedisWindow] = []
        self._retiring: set[asyncio.Task[None]] = set()

    async def admit(self, tenant: TenantConfig, model: str) -> Ticket:
        """A ticket for the request, or raise RateLimited (429) or Unavailable (503).
        `model` is the public name the client sent; per-model windows count its served name.

        Nothing is held when this raises, including on cancellation.
        """
        slot = self._concurrency.try_acquire(tenant.id, tenant.max_in_flight)
        if slot is None:
            self.metrics.decision("concurrency_limited")
            raise RateLimited(
                f"Too many requests in flight for tenant {tenant.id} (limit {tenant.max_in_flight}). "
                "Retry when an earlier request finishes.",
                code="concurrency_limit_exceeded",
                headers={"Retry-After": "1"},
            )
        try:
            headers = await self._check_windows(tenant, model)
        except BaseException:
            slot.release()
            raise
        self.metrics.decision("admitted")
        return Ticket(slot, headers)

    def in_flight(self, tenant_id: str) -> int:
        return self._concurrency.in_flight(tenant_id)

    def reconfigure(self, config: Config) -> None:
        """Take new limits. Window and in-flight state is kept: it is keyed by tenant
        and served model name, and limits are read from the TenantConfig passed to `admit`."""
        old, new = self._limits, config.limits
        self._limits = new
        self._per_model = PerModelLimits(config)
        if (old.redis_url, old.redis_timeout_ms, old.redis_cluster, old.redis_auth) == (
                new.redis_url, new.redis_timeout_ms, new.redis_cluster, new.redis_auth):
            return
        if self._redis is not None:
            self._retire(self._redis)
        self._redis = self._make_redis(new)

    async def close(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        windows = [*self._retired, *([self._redis] if self._redis else [])]
        self._retired.clear()
        self._redis = None
        for window in windows:
            await window.close()

    async def _check_windows(self, tenant: TenantConfig, model: str) -> dict[str, str]:
        limits, labels = self._window_limits(tenant, model)
        if not limits:
            return {}
        local = self._local.try_acquire_all(limits)
        index = binding(local)
        first = local[index]
        if not first.allowed:
            raise self._rate_limited(tenant, labels[index], first)
        redis = self._redis
        if redis is None:
            return ratelimit_headers(first)

        try:
            shared = await redis.try_acquire_all(limits)
        except RedisUnavailable as exc:
            self.metrics.redis_error()
            if self._limits.redis_fail_open:
                self.metrics.fail_open()
                if self._fail_open_log.ready():
                    log.warning(
                        "Redis rate limiting failed (%s); admitting on local limits only because "
                        "limits.redis_fail_open is set (%d such requests so far)",
                        exc,
                        self.metrics.fail_open_passes,
                    )
                return ratelimit_headers(first)
            self._undo_local(limits, first)
            self.metrics.decision("unavailable")
            if self._fail_closed_log.ready():
                log.warning("Redis rate limiting failed (%s); rejecting requests with 503", exc)
            raise limiter_unavailable() from None
        except BaseException:
            self._undo_local(limits, first)
            raise

        index = binding(shared)
        if not shared[index].allowed:
            # Redis is the truth; give the local slot back so local counts do not drift upward.
            self._undo_local(limits, first)
            raise self._rate_limited(tenant, labels[index], shared[index])
        return ratelimit_headers(shared[index])

    def _window_limits(self, tenant: TenantConfig, model: str) -> tuple[list[tuple[str, int]], list[str]]:
        limits: list[tuple[str, int]] = []
        labels: list[str] = []
        if tenant.requests_per_minute > 0:
            limits.append((tenant_key(tenant.id), tenant.requests_per_minute))
            labels.append(f"tenant {tenant.id}")
        if tenant.requests_per_minute_per_model:
            # Counted per served name, so an alias shares the window of the model it serves.
            per_model = self._per_model.lookup(tenant, model)
            if per_model.limit > 0:
                limits.append((model_key(tenant.id, per_model.upstream), per_model.limit))
                via = f" (requested as {model})" if per_model.upstream != model else ""
                labels.append(f"tenant {tenant.id} on model {per_model.upstream}{via}")
        return limits, labels

    def _undo_local(self, limits: list[tuple[str, int]], decision: Decision) -> None:
        for key, _ in limits:
            self._local.undo(key, decision.at)

    def _rate_limited(self, tenant: TenantConfig, label: str, decision: Decision) -> RateLimited:
        self.metrics.decision("rate_limited")
        return RateLimited(
            f"Rate limit reached for requests per minute for {label} (limit {decision.limit}). "
            f"Try again in {format_duration(decision.retry_after_s)}.",
            headers=rejection_headers(decision),
        )

    def _make_redis(self, limits: LimitsConfig) -> RedisWindow | None:
        if limits.redis_url is None:
            return None
        url, timeout_s = limits.redis_url, limits.redis_timeout_ms / 1000
        factory = self._redis_client_factory or make_client_factory(batch=False, cluster=limits.redis_cluster,
                                                                    auth=limits.redis_auth)
        return RedisWindow(
            lambda: factory(url, timeout_s),
            timeout_s=timeout_s,
            window_seconds=self._window_seconds,
            metrics=self._redis_metrics,
        )

    def _retire(self, window: RedisWindow) -> None:
        """Close a replaced client once calls already using it are over (they are time-bounded)."""
        self._retired.append(window)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # closed by close()
        task = loop.create_task(self._close_later(window, window.timeout_s * 2 + 0.1))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _close_later(self, window: RedisWindow, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self._retired.remove(window)
        await asyncio.shield(window.close())
