"""Refuse to pile on when every candidate is already overloaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from modeldock.errors import RateLimited, Rejection, Unavailable
from modeldock.picking.signals import Signals


@dataclass(frozen=True)
class Saturation:
    """An endpoint is saturated when its FRESH sample shows waiting >= max_waiting
    or kv >= max_kv (None turns a test off). Stale endpoints are never saturated:
    nothing says they are full. When all candidates are saturated, pick raises
    429 (rate_limited, Retry-After) or 503 (unavailable, Retry-After)."""

    max_waiting: float | None = None
    max_kv: float | None = None
    reject: Literal["rate_limited", "unavailable"] = "rate_limited"
    retry_after_seconds: int = 1

    def __post_init__(self) -> None:
        if self.reject not in ("rate_limited", "unavailable"):
            raise ValueError("saturation reject must be 'rate_limited' or 'unavailable'")
        if self.max_kv is not None and not 0.0 < self.max_kv <= 1.0:
            raise ValueError("saturation max_kv must be a fraction in (0, 1]")

    @property
    def enabled(self) -> bool:
        return self.max_waiting is not None or self.max_kv is not None

    def over(self, s: Signals) -> bool:
        if not s.fresh:
            return False
        if self.max_waiting is not None and s.waiting >= self.max_waiting:
            return True
        return self.max_kv is not None and s.kv >= self.max_kv

    def rejection(self, model: str, candidates: int) -> Rejection:
        limits = []
        if self.max_waiting is not None:
            limits.append(f"queue >= {self.max_waiting:g}")
        if self.max_kv is not None:
            limits.append(f"KV cache >= {self.max_kv:.0%}")
        message = (f"All {candidates} endpoints for model {model!r} are saturated "
                   f"({' or '.join(limits)}); retry in {self.retry_after_seconds}s.")
        headers = {"Retry-After": str(self.retry_after_seconds)}
        if self.reject == "unavailable":
            return Unavailable(message, code="endpoints_saturated", headers=headers)
        return RateLimited(message, code="endpoints_saturated", headers=headers)
