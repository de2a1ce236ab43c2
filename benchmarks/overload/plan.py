"""The overload benchmark's pure parts: tenants, gateway configs, arrival schedules, capacity and
result aggregation. No network, no processes; tested in tests/unit/bench/test_overload_plan.py.

Times here are wall-clock seconds and rates are requests per wall-clock second: the benchmark's
driver is called with speed 1, and the simulators' `--speed` only sets how fast the pool is.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.routing.workloads import Request, poisson_times, text
from modeldock.bench.stats import nearest_rank
from modeldock.config import hash_key

MODEL = "demo-model"

# -- tenants and gateway configs ---------------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    id: str
    key: str  # the API key the client sends; the config holds only its hash
    weight: float = 1.0  # fair share in the queue (equal weights: equal shares)
    klass: str = "standard"  # the queue's priority class


TENANTS: tuple[Tenant, ...] = (
    Tenant("main", "md-bench-main-0123456789"),  # overload and below-capacity scenarios
    Tenant("alice", "md-bench-alice-0123456789"),  # noisy neighbour: the noisy one
    Tenant("bob", "md-bench-bob-0123456789"),  # noisy neighbour: the quiet one
    Tenant("ivy", "md-bench-ivy-0123456789", klass="interactive"),  # priority: steady interactive load
    Tenant("bat", "md-bench-bat-0123456789", klass="batch"),  # priority: the batch flood
)

# The names the tenant config gives the queue's per-tenant fields. Written only for configs with
# `tenant_fields=True`: today's config (extra="forbid") rejects them.
TENANT_FIELDS = {"weight": "weight", "klass": "priority"}


@dataclass(frozen=True)
class GatewayConfig:
    """One contender: what it adds to the generated config.

    `routing` is merged into `routing:`, `extra` is added at the top level (e.g. `{"queue": {...}}`),
    `model` into the model's entry (a null value removes a key the pool gives it, e.g.
    `{"max_num_seqs": null}`: learn the batch limit), and `tenant_fields` writes each tenant's weight
    and class into its tenant entry."""

    name: str
    description: str
    routing: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    tenant_fields: bool = False


# The previous default, for comparison: no queue, no room-based saturation, the load weights it had.
_BEFORE: dict[str, Any] = {"weights": {"kv": 0.3, "kv_headroom": 0.0, "predicted_wait": 0.0}}
_NO_QUEUE: dict[str, Any] = {"queue": {"enabled": False}}

# The lineup, in run order. Every contender gets the tenants' weights and classes (the fields are
# read only by the queue).
CONFIGS: tuple[GatewayConfig, ...] = (
    GatewayConfig("noqueue", "the previous default: no queue, no saturation limits, everything is sent",
                  routing={**_BEFORE, "saturation": {"room": False}}, extra=_NO_QUEUE, tenant_fields=True),
    GatewayConfig("threshold", "the previous default, shedding with 429 when every endpoint shows waiting >= 1 "
                  "or KV >= 92%",
                  routing={**_BEFORE, "saturation": {"room": False, "max_waiting": 1, "max_kv": 0.92}},
                  extra=_NO_QUEUE, tenant_fields=True),
    GatewayConfig("queue", "today's out-of-the-box config: saturation by room, the fair queue",
                  tenant_fields=True),
)


def parse_config_arg(spec: str, known: Sequence[GatewayConfig]) -> GatewayConfig:
    """`NAME=JSON` with optional keys description/routing/extra/tenant_fields: a new contender, or
    (for a known NAME) that contender with those keys replaced."""
    name, sep, raw = spec.partition("=")
    if not sep or not name:
        raise ValueError(f"expected NAME=JSON, got {spec!r}")
    data = json.loads(raw) if raw.strip() else {}
    if not isinstance(data, dict) or set(data) - {"description", "routing", "extra", "model", "tenant_fields"}:
        raise ValueError("the JSON must be an object with description, routing, extra, model or tenant_fields")
    base = next((c for c in known if c.name == name), GatewayConfig(name, name))
    return replace(base, **data)


def gateway_config(cfg: GatewayConfig, tenants: Iterable[Tenant], endpoints: Sequence[str],
                   model: str = MODEL, pool: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole YAML config (as a dict) for one contender: every tenant with its own key. `pool`:
    what every contender's model entry says of the backends (their `max_num_seqs`)."""
    entries = []
    for t in tenants:
        entry: dict[str, Any] = {"id": t.id, "api_key_hashes": [hash_key(t.key)], "models": ["demo-*"]}
        if cfg.tenant_fields:
            entry[TENANT_FIELDS["weight"]] = t.weight
            entry[TENANT_FIELDS["klass"]] = t.klass
        entries.append(entry)
    entry = {"name": model, "endpoints": list(endpoints), **(pool or {}), **cfg.model}
    data: dict[str, Any] = {"tenants": entries, "models": [{k: v for k, v in entry.items() if v is not None}]}
    if cfg.routing:
        data["routing"] = json.loads(json.dumps(cfg.routing))  # a copy the stack may not share
    for key, value in cfg.extra.items():
        data[key] = json.loads(json.dumps(value))
    return data


# -- arrivals ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mix:
    """Request shapes: short answers and long generations; prompts in tokens (4 characters each)."""

    long_fraction: float = 0.2
    short_tokens: int = 32
    long_tokens: int = 256
    prompt_tokens: tuple[int, int] = (64, 512)

    def only_short(self) -> Mix:
        return replace(self, long_fraction=0.0)


# Kinds are dealt in blocks of this many requests, each with its share of long ones in a random
# order: every stretch of a schedule then has the mix's long fraction, where independent draws
# gave a capacity run's 160 requests and an overload phase's 550 different fractions (a seed's
# capacity read 17.0 requests/s, 10 % above what the pool then served of the overload phase).
KIND_BLOCK = 20


def _kinds(k: int, fraction: float, rng: random.Random) -> list[str]:
    """Block `k`: round(fraction x requests so far) long ones in all, its own in a random order."""
    longs = round((k + 1) * KIND_BLOCK * fraction) - round(k * KIND_BLOCK * fraction)
    kinds = ["long"] * longs + ["short"] * (KIND_BLOCK - longs)
    rng.shuffle(kinds)
    return kinds


def arrivals(seed: int, label: str, rate: float, duration: float, mix: Mix, first_index: int = 0,
             start: float = 0.0) -> list[Request]:
    """Open-loop Poisson arrivals of `rate` per second over [start, start + duration), seeded by
    (seed, label): the same call gives the same requests byte for byte, whatever the config.
    Kinds are dealt in blocks of KIND_BLOCK (the long fraction holds in every block).
    Prompts begin with a unique word, so no two share a prefix-cache block."""
    rng = random.Random(f"overload:{label}:{seed}")
    out = []
    block: list[str] = []
    for n, at in enumerate(poisson_times(rng, rate, duration, start)):
        if n % KIND_BLOCK == 0:
            block = _kinds(n // KIND_BLOCK, mix.long_fraction, rng)
        kind = block[n % KIND_BLOCK]
        tokens = rng.randint(*mix.prompt_tokens)
        content = text(tokens, rng, head=f"{label}{seed}-{n}")
        out.append(Request(first_index + n, at, kind, ({"role": "user", "content": content},),
                           mix.long_tokens if kind == "long" else mix.short_tokens, tokens))
    return out


def closed_loop_requests(seed: int, count: int, mix: Mix) -> list[Request]:
    """`count` requests of the mix for the closed-loop capacity run (arrival times unused)."""
    out = arrivals(seed, "cap", 1.0, 3.0 * count + 30.0, mix)[:count]
    if len(out) < count:  # a Poisson count this far below its mean does not happen in practice
        raise ValueError("too few arrivals; raise the span")
    return out


# -- capacity ---------------------------------------------------------------------------------


def throughput(ends: Iterable[float], begin: float, end: float) -> float:
    """Completions per second whose end time falls in [begin, end)."""
    if end <= begin:
        raise ValueError("an empty window")
    return sum(1 for t in ends if begin <= t < end) / (end - begin)


@dataclass(frozen=True)
class Capacity:
    rate: float  # requests per second the pool completed with every running slot kept busy
    concurrency: int
    completed: int  # completions inside the window
    window_s: float
    ttft_p95: float | None  # of the requests completed inside the window


def capacity(ends: Sequence[float], ttfts: Sequence[float | None], t0: float, warmup: float, duration: float,
             concurrency: int) -> Capacity:
    """From a closed-loop run started at `t0`: completions per second over [t0 + warmup, t0 + duration).
    `ends[i]` and `ttfts[i]` belong to the same request (ttft None: it failed)."""
    begin, end = t0 + warmup, t0 + duration
    inside = [i for i, t in enumerate(ends) if begin <= t < end]
    values = [v for i in inside if (v := ttfts[i]) is not None]
    return Capacity(throughput(ends, begin, end), concurrency, len(inside), end - begin,
                    nearest_rank(values, 95) if values else None)


# -- outcomes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One request's fate, as the aggregation needs it."""

    tenant: str
    error: str | None  # None: served (a complete stream); else "429", "503", "timeout", ...
    ttft: float | None
    e2e: float | None
    detail: str | None = None  # the error body's start (300 characters at most)
    kind: str | None = None  # the request's class: "short" or "long"


def clean_429(detail: str | None) -> bool | None:
    """True if the body is OpenAI-shaped JSON `{"error": {"message", "type", "param", "code"}}`; None
    if it was cut at the recorded 300 characters and cannot be checked; False otherwise."""
    if detail is None:
        return False
    try:
        body = json.loads(detail)
    except ValueError:
        return None if len(detail) >= 300 else False
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err)
            and isinstance(err["message"], str) and bool(err["message"]))


def _pct(values: Sequence[float], p: float) -> float | None:
    return nearest_rank(values, p) if values else None


def aggregate(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Offered, served and rejected counts and shares, whether every 429 was clean JSON, and the
    served requests' TTFT and E2E percentiles (seconds, nearest rank)."""
    n = len(outcomes)
    served = [o for o in outcomes if o.error is None]
    r429 = [o for o in outcomes if o.error == "429"]
    checks = Counter(clean_429(o.detail) for o in r429)
    ttfts = [o.ttft for o in served if o.ttft is not None]
    e2es = [o.e2e for o in served if o.e2e is not None]
    return {
        "offered": n,
        "served": len(served),
        "served_pct": 100.0 * len(served) / n if n else None,
        "r429": len(r429),
        "r429_pct": 100.0 * len(r429) / n if n else None,
        "r429_clean": checks[True],
        "r429_unclean": checks[False],
        "r429_unchecked": checks[None],
        "other_errors": dict(Counter(o.error for o in outcomes if o.error not in (None, "429"))),
        "ttft_p50": _pct(ttfts, 50), "ttft_p95": _pct(ttfts, 95), "ttft_p99": _pct(ttfts, 99),
        "e2e_p50": _pct(e2es, 50), "e2e_p95": _pct(e2es, 95),
    }


def by_tenant(outcomes: Sequence[Outcome]) -> dict[str, dict[str, Any]]:
    tenants = sorted({o.tenant for o in outcomes})
    return {t: aggregate([o for o in outcomes if o.tenant == t]) for t in tenants}


def by_class(outcomes: Sequence[Outcome]) -> dict[str, dict[str, Any]]:
    """The aggregate of each request class (short, long) apart: a pooled p95 can move from one class
    into the other when the mix of served requests changes, so each class is reported on its own too."""
    kinds = sorted({o.kind for o in outcomes if o.kind is not None})
    return {k: aggregate([o for o in outcomes if o.kind == k]) for k in kinds}


# -- replicas ---------------------------------------------------------------------------------


def route(n: int, live: Sequence[bool]) -> int:
    """The replica the n-th arrival of a round robin goes to: n mod replicas, or, if that replica is
    down, the next live one after it (its clients fail over to the survivors)."""
    if not any(live):
        raise ValueError("no live replica")
    first = n % len(live)
    return next(i % len(live) for i in range(first, first + len(live)) if live[i % len(live)])


def counter_between(samples: Sequence[tuple[float, float]], begin: float, end: float) -> float | None:
    """How much a sampled counter grew over [begin, end]: the last sample at or before `end` minus the
    last one at or before `begin` (None without a sample at or before `begin`)."""
    before = [v for t, v in samples if t <= begin]
    upto = [v for t, v in samples if t <= end]
    return upto[-1] - before[-1] if before else None


def back_above_zero(samples: Sequence[tuple[float, float | None]], since: float) -> float | None:
    """Seconds from `since` to the first sample at or after it whose value is above 0 (a gauge that is
    back), None if it never is (or the metric is not exported: value None)."""
    return next((t - since for t, v in samples if t >= since and v is not None and v > 0), None)


def bootstrap_p95(values: Sequence[float], seed: int = 0, rounds: int = 400) -> tuple[float, float] | None:
    """A 90% bootstrap interval of the nearest-rank p95: how much of a p95 difference is sampling
    noise."""
    if len(values) < 2:
        return None
    rng = random.Random(seed)
    stats = sorted(nearest_rank(rng.choices(values, k=len(values)), 95) for _ in range(rounds))
    return stats[int(0.05 * rounds)], stats[int(0.95 * rounds) - 1]


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
