"""Refuse (or queue) instead of piling on when no candidate has room for one more request."""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Literal

from modeldock.errors import RateLimited, Rejection, Unavailable
from modeldock.picking.signals import Signals

UNKNOWN_LIMIT = 4.0  # batch slots assumed for the token headroom while the limit is not learned


class Saturated(Rejection):
    """Every candidate is saturated. The gateway's queue catches it (the request waits for
    room); with the queue off it is the 429 or 503 below."""


class SaturatedRateLimited(Saturated, RateLimited):
    pass


class SaturatedUnavailable(Saturated, Unavailable):
    pass


def held_tokens(s: Signals, output: int | None) -> float:
    """The most KV the endpoint's other sequences can hold while a request with `output` tokens of
    output limit runs there: at most the tokens this gateway committed on it (prompt + output
    limit of each), and, from a fresh sample with the speed known, at most what they hold now
    plus `output` more each. In continuous batching every running sequence gains at most one
    token per engine step, as the new one does, so while it produces `output` tokens no other
    grows by more; once it is done its KV is free again, and every sequence still there was
    checked the same way when it came. This lets a short request join a batch of long ones
    whose full limits would not fit together but will not all be reached while it runs.

    "Now" is the sample's KV plus the prompts of the requests picked since it (their committed
    tokens less their output limits: a request's KV starts as its prompt and grows like every
    other sequence, which the output term counts, since they are among the waiting), plus what
    the endpoint's sequences have grown since the sample at its learned output rate (`growth`,
    from vllm:generation_tokens_total; prefills are the prompts above; a page without that
    counter falls back to the whole token rate, `speed`, prompts included: an over-estimate).
    Waiting requests in the sample count among the sequences that grow. Less what the requests
    that finished since held when it was read, as far as known (`Signals.freed`): the page read
    after each ending (scrape.py) says it exactly, but a queued request is tried at the ending."""
    committed = float(s.committed)
    now = _growing_now(s) if output is not None else None
    if now is None or output is None:
        return committed
    return min(committed, now + (s.running + s.waiting) * output)


def _growing_now(s: Signals) -> float | None:
    """The KV the endpoint's sequences hold now (see `held_tokens`); None without a fresh sample
    and a learned rate."""
    rate = s.growth if s.growth > 0 else s.speed
    if not s.fresh or rate <= 0 or s.capacity <= 0:
        return None
    return s.kv * s.capacity - s.freed + s.new_tokens - s.new_outputs + s.age * rate


def _sequences(s: Signals) -> float:
    """Sequences on the endpoint: the page's running + waiting (corrected), or this gateway's
    requests there when it counts more."""
    return max(float(s.in_flight), s.running + s.waiting)


def fits_as_they_finish(s: Signals, cost: int, output: int, capacity: float) -> bool:
    """Whether a request (`cost` tokens, `output` of them its output limit) fits beside the
    endpoint's sequences, counting that each of this gateway's is done within the steps it has
    left (`Signals.ends`: its output limit, less the engine steps the pages showed it running)
    and frees its KV then: a long request joins short ones whose limits it would not fit beside,
    or long ones near their end, because they are gone before it has grown. At step k of the new
    request (it holds its prompt + k) the others hold at most their committed tokens, and at
    most what they hold now plus k each, counting only those with more than k steps left (one
    with r left grows at most r more); the peak is at the last step one of them may still run
    (k = r - 1) or at the new one's last. Sequences of no known limit (other gateways', the
    backend's queue, ours that did not say theirs) run throughout. Needs a fresh sample and a
    learned rate (else False: `held_tokens` decides alone)."""
    now = _growing_now(s)
    ends = s.ends
    if now is None or not ends:
        return False
    prompt = cost - output
    n = len(ends)
    unknown = _sequences(s) - n  # run throughout
    committed = float(s.committed)  # ours that may still run, lowered as they finish
    steps = s.steps
    i = 0
    while True:
        left = ceil(ends[i][0] - steps) if i < n else output + 1  # at most this many steps to go
        k = output if left > output else max(0, left - 1)
        if min(committed, now + (unknown + n - i) * k) + prompt + k > capacity:
            return False
        if k == output:
            return True
        while i < n and ceil(ends[i][0] - steps) <= k + 1:
            committed -= ends[i][1]  # done by the next step: their KV is free
            i += 1


@dataclass(frozen=True)
class Saturation:
    """When is an endpoint too full for one more request (of `cost` tokens)?

    Room (`room=True`, the config's default): when one more request would not fit:
      - its fresh sample shows requests waiting in the backend's own queue, less the requests
        that finished since (each let one in): a request sent now would wait there, where no
        fairness or priority applies, so it waits in the gateway's queue instead;
      - its fresh sample's running + waiting, corrected for picks and completions since, reach
        the learned batch limit (`Signals.limit`, the most requests seen running while others
        waited: max_num_seqs or the KV bound), so a burst between two samples is not pushed
        into the backend's queue; with a stale sample, this gateway's in-flight count does;
      - its fresh sample shows requests waiting (corrected: picks since the sample count as
        waiting) while its KV cache is at least `kv_full` used (less the committed tokens of the
        sample's requests that finished since, with the capacity known): vLLM is queueing for memory;
      - or, its KV capacity known (vllm:cache_config_info), the tokens held there while this
        request runs (`held_tokens`) plus `cost` exceed it: a request that will not fit would
        preempt or wait (an endpoint with nothing in flight always takes one, whatever its size);
      - or its sample is stale (or missing) and the local counts say it is full: the tokens
        rule above, or `stale_max_in_flight` requests in flight when set.
    Headroom (`over(..., headroom=h, headroom_tokens=t)`, h or t > 0: a request that must leave
    room for protected ones, a lower class or a tenant over its share): the batch limit rules
    count `h` slots fewer (never below one) and the tokens rule `t` tokens fewer (at most half the
    capacity; by default the capacity's share of `h` slots, of UNKNOWN_LIMIT while the batch
    limit is not learned: the token rule must keep room even when the backend never queued), so
    the last slots stay free for the top class and for tenants under their share. A protected
    request (h = t = 0) may use the last slot.
    Paged KV: with the block size known, the tokens rule takes `block - 1` tokens per sequence
    there and for the new one off the capacity (each may hold a part-empty last block).
    Thresholds (the older knobs, None turns each off): a FRESH sample showing
    `waiting >= max_waiting` or `kv >= max_kv`. Stale endpoints are never over a threshold.

    When every candidate is saturated, pick raises `Saturated`: 429 (rate_limited) or 503
    (unavailable), code `endpoints_saturated`, with Retry-After.
    """

    max_waiting: float | None = None
    max_kv: float | None = None
    reject: Literal["rate_limited", "unavailable"] = "rate_limited"
    retry_after_seconds: int = 1
    room: bool = False
    kv_full: float = 0.9
    stale_max_in_flight: int | None = None

    def __post_init__(self) -> None:
        if self.reject not in ("rate_limited", "unavailable"):
            raise ValueError("saturation reject must be 'rate_limited' or 'unavailable'")
        if self.max_kv is not None and not 0.0 < self.max_kv <= 1.0:
            raise ValueError("saturation max_kv must be a fraction in (0, 1]")
        if not 0.0 < self.kv_full <= 1.0:
            raise ValueError("saturation kv_full must be a fraction in (0, 1]")
        if self.stale_max_in_flight is not None and self.stale_max_in_flight < 1:
            raise ValueError("saturation stale_max_in_flight must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.room or self.max_waiting is not None or self.max_kv is not None

    def over(self, s: Signals, cost: int = 0, headroom: int = 0, headroom_tokens: int | None = None,
             output: int | None = None) -> bool:
        if self.room:
            limit = s.limit
            capacity = s.capacity
            known = capacity > 0  # the margins below may use it all up: then there is no room
            if headroom > 0:
                if headroom_tokens is None and capacity > 0:
                    # The capacity's share of the kept slots; a batch limit not learned yet (the
                    # backend never queued) counts as UNKNOWN_LIMIT slots.
                    slots = limit if limit > 0 else UNKNOWN_LIMIT
                    headroom_tokens = int(capacity * min(headroom, slots - 1) / slots)
                if limit > 0:
                    limit = max(1.0, limit - headroom)
            if headroom_tokens and capacity > 0:
                # At most half the cache is kept: the others' share never goes to nothing.
                capacity -= min(float(headroom_tokens), capacity / 2)
            if s.block > 1 and capacity > 0:
                # The cache is paged: each sequence's last block is part empty (up to block - 1
                # tokens more than the tokens counted, the new one's too).
                capacity -= (s.block - 1) * (_sequences(s) + 1)
            if (s.in_flight and known and held_tokens(s, output) + cost > capacity
                    and (output is None or not fits_as_they_finish(s, cost, output, capacity))):
                return True
            if s.fresh:
                kv = s.kv
                if s.gone_tokens and s.capacity > 0:  # what finished since the sample freed its KV
                    kv -= s.gone_tokens / s.capacity
                if s.backlog > 0 or (s.waiting >= 1 and kv >= self.kv_full):
                    return True
                if limit > 0 and s.running + s.waiting >= limit:
                    return True
            elif limit > 0 and s.in_flight >= limit:
                return True
            elif (self.stale_max_in_flight is not None
                  and s.in_flight >= max(1, self.stale_max_in_flight - headroom)):
                return True
        if not s.fresh:
            return False
        if self.max_waiting is not None and s.waiting >= self.max_waiting:
            return True
        return self.max_kv is not None and s.kv >= self.max_kv

    def rejection(self, model: str, candidates: int) -> Saturated:
        limits = []
        if self.room:
            limits.append("no room for this request")
        if self.max_waiting is not None:
            limits.append(f"queue >= {self.max_waiting:g}")
        if self.max_kv is not None:
            limits.append(f"KV cache >= {self.max_kv:.0%}")
        message = (f"All {candidates} endpoints for model {model!r} are saturated "
                   f"({' or '.join(limits)}); retry in {self.retry_after_seconds}s.")
        headers = {"Retry-After": str(self.retry_after_seconds)}
        if self.reject == "unavailable":
            return SaturatedUnavailable(message, code="endpoints_saturated", headers=headers)
        return SaturatedRateLimited(message, code="endpoints_saturated", headers=headers)
