"""The `queue:` section: how long and how full the flow-control queue may get.

Mounted into the main config as `queue:`; tenants' class and weight come from
tenant config and are passed to the queue as plain arguments.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

CLASS_NAME = r"^[A-Za-z0-9._-]+$"


class QueueConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    # Items waiting per model queue, over all classes and tenants.
    max_length: Annotated[int, Field(ge=1)] = 256
    # Items one tenant may have waiting per model queue; None = only max_length bounds it.
    max_per_tenant: Annotated[int, Field(ge=1)] | None = None
    # An interactive client gives up after a few seconds; waiting longer only wastes a slot.
    ttl_seconds: Annotated[float, Field(gt=0, le=600)] = 10.0
    # Shed early: once the oldest request queued has waited half this long, a request is refused at once
    # (429 queue_full) when the requests queued ahead of it (its class and higher, in fair order) hold
    # more tokens than the model's endpoints process in this many seconds (their tokens/s while full);
    # None: only the TTL and max_length bound a wait.
    max_wait_seconds: Annotated[float, Field(gt=0, le=600)] | None = 0.5
    retry_after_seconds: Annotated[int, Field(ge=1, le=3600)] = 1
    # A request that does not fit may be passed by smaller ones behind it (in its class) that do,
    # until it has waited this long; then it blocks the queue until room for it frees. 0: strict order.
    # Twice max_wait_seconds: the drain budget admits a request expecting it to start within about
    # max_wait, and blocking at that age kept slots idle that requests behind the head could use
    # (the overload benchmark and its exact-knowledge replay, docs/benchmarks.md).
    backfill_seconds: Annotated[float, Field(ge=0, le=600)] = 1.0
    # Class name -> priority; a higher number is always dispatched first and shed last.
    classes: dict[Annotated[str, Field(min_length=1, max_length=64, pattern=CLASS_NAME)], int] = Field(
        default_factory=lambda: {"interactive": 2, "standard": 1, "batch": 0}, min_length=1
    )
    default_class: str = "standard"
    # Headroom (standing.py): at a full endpoint, a request of a class below one seen on the model in
    # the last `headroom_window_seconds`, or of a tenant served over its weighted share of the model's
    # tokens lately, sees the endpoint as full `headroom` slots (and `headroom_tokens` tokens of KV;
    # None: per slot, what the recent protected requests cost) before its limit: those stay free for
    # protected requests.
    # 0 (and headroom_tokens 0 or None) turns it off: the queue is then purely work-conserving.
    headroom: Annotated[int, Field(ge=0)] = 1
    headroom_tokens: Annotated[int, Field(ge=0)] | None = None
    headroom_window_seconds: Annotated[float, Field(gt=0, le=600)] = 2.0
    # The time constant of each tenant's served-tokens average that decides "over its share": long
    # enough that a tenant's clumps of arrivals within its share do not count as over it.
    share_window_seconds: Annotated[float, Field(gt=0, le=600)] = 10.0
    # Output tokens assumed for a request that sets neither max_completion_tokens nor max_tokens.
    default_max_tokens: Annotated[int, Field(ge=1)] = 256

    @model_validator(mode="after")
    def _default_class_exists(self) -> QueueConfig:
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not one of classes {sorted(self.classes)}")
        return self

    def priority(self, klass: str) -> int:
        """The priority of a class name; ValueError for a name the config does not define."""
        try:
            return self.classes[klass]
        except KeyError:
            raise ValueError(f"unknown queue class {klass!r}; known: {sorted(self.classes)}") from None
