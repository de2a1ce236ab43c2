"""The options a benchmark runs with and the results it returns (plain dataclasses)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from modeldock.bench.metrics import Endpoint, RequestRecord, e2e, tpot, ttft
from modeldock.bench.stats import Summary, summarize

# Bumped when the JSON shape changes incompatibly.
SCHEMA = "modeldock.bench/1"


@dataclass(frozen=True)
class BenchOptions:
    url: str  # base URL, e.g. http://127.0.0.1:8080/v1
    model: str
    requests: int = 100  # measured requests per tier
    concurrency: tuple[int, ...] = (1,)  # tiers, run one after another
    warmup: int = 0  # unmeasured requests per tier, before the measured ones
    prompt_tokens: int = 128
    max_tokens: int = 128
    endpoint: Endpoint = "chat"
    usage: bool = False  # ask for stream_options.include_usage
    timeout: float = 60.0  # seconds, per request, send to end of stream
    token: str | None = field(default=None, repr=False)  # bearer token; never reported
    shared_prompt: bool = False  # one prompt for all requests (lets prefix caches help)

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be chat or completions, got {self.endpoint!r}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError("every concurrency tier must be at least 1")
        if self.requests < 1:
            raise ValueError("requests must be at least 1")
        if self.warmup < 0:
            raise ValueError("warmup cannot be negative")
        if self.prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be at least 1")
        if self.timeout <= 0:
            raise ValueError("timeout must be positive")


@dataclass(frozen=True)
class TierParams:
    """The parameters a tier ran with, reported next to its numbers."""

    url: str
    model: str
    endpoint: Endpoint
    prompt_tokens: int
    max_tokens: int
    warmup: int
    concurrency: int
    requests: int
    usage: bool
    timeout: float
    shared_prompt: bool
    started_at: str  # ISO 8601 UTC, when the tier's warmup began

    @classmethod
    def of(cls, options: BenchOptions, concurrency: int, started_at: str) -> TierParams:
        return cls(
            url=options.url,
            model=options.model,
            endpoint=options.endpoint,
            prompt_tokens=options.prompt_tokens,
            max_tokens=options.max_tokens,
            warmup=options.warmup,
            concurrency=concurrency,
            requests=options.requests,
            usage=options.usage,
            timeout=options.timeout,
            shared_prompt=options.shared_prompt,
            started_at=started_at,
        )


@dataclass
class TierResult:
    params: TierParams
    completed: int
    errors: dict[str, int]  # kind ("429", "timeout", "truncated", ...) -> count
    error_details: dict[str, str]  # kind -> the first detail seen, to explain it
    wall_time_s: float  # first measured send to last measured finish
    requests_per_s: float  # completed requests / wall time
    output_tokens_per_s: float | None  # None unless every completed request had usage
    usage_reported: int  # completed requests that carried usage
    ttft: Summary
    tpot: Summary
    e2e: Summary
    records: list[RequestRecord] = field(default_factory=list, repr=False)

    @property
    def error_total(self) -> int:
        return sum(self.errors.values())

    def samples(self) -> dict[str, list[float]]:
        """The raw per-request values behind the summaries, completed requests only."""
        return latency_samples(self.records)

    def to_dict(self, include_samples: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "params": asdict(self.params),
            "completed": self.completed,
            "errors": dict(self.errors),
            "error_total": self.error_total,
            "error_details": dict(self.error_details),
            "wall_time_s": self.wall_time_s,
            "throughput": {
                "requests_per_s": self.requests_per_s,
                "output_tokens_per_s": self.output_tokens_per_s,
            },
            "usage_reported": self.usage_reported,
            "ttft_s": self.ttft.to_dict(),
            "tpot_s": self.tpot.to_dict(),
            "e2e_s": self.e2e.to_dict(),
        }
        if include_samples:
            out["samples"] = self.samples()
        return out


@dataclass
class BenchResult:
    started_at: str  # ISO 8601 UTC, when the run began
    tiers: list[TierResult]

    def to_dict(self, include_samples: bool = False) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "started_at": self.started_at,
            "tiers": [t.to_dict(include_samples) for t in self.tiers],
        }


def tier_result(params: TierParams, records: list[RequestRecord], wall_time_s: float) -> TierResult:
    """Aggregate one tier. Failed requests are counted by kind and never timed."""
    done = [r for r in records if r.completed]
    errors: dict[str, int] = {}
    details: dict[str, str] = {}
    for r in records:
        if r.completed:
            continue
        kind = r.error or "unknown"
        errors[kind] = errors.get(kind, 0) + 1
        if r.detail and kind not in details:
            details[kind] = r.detail
    with_usage = [r for r in done if r.completion_tokens is not None]
    samples = latency_samples(records)
    tokens_per_s = None
    # A partial token count would understate throughput, so all or nothing.
    if done and len(with_usage) == len(done) and wall_time_s > 0:
        tokens_per_s = sum(r.completion_tokens or 0 for r in done) / wall_time_s
    return TierResult(
        params=params,
        completed=len(done),
        errors=dict(sorted(errors.items())),
        error_details=details,
        wall_time_s=wall_time_s,
        requests_per_s=len(done) / wall_time_s if wall_time_s > 0 else 0.0,
        output_tokens_per_s=tokens_per_s,
        usage_reported=len(with_usage),
        ttft=summarize(samples["ttft_s"]),
        tpot=summarize(samples["tpot_s"]),
        e2e=summarize(samples["e2e_s"]),
        records=records,
    )


def latency_samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Per-request TTFT/TPOT/E2E in seconds; failed requests contribute nothing."""
    done = [r for r in records if r.completed]
    return {
        "ttft_s": [v for r in done if (v := ttft(r)) is not None],
        "tpot_s": [v for r in done if (v := tpot(r)) is not None],
        "e2e_s": [v for r in done if (v := e2e(r)) is not None],
    }
