"""What an endpoint can hold and how fast it works, from its parsed vLLM /metrics.

Pure functions over prometheus_client's parsed families
(`prometheus_client.parser.text_string_to_metric_families`), so the scraper that
owns parsing can call them on what it already has.

- KV capacity in tokens: vLLM exports its CacheConfig as the info-style gauge
  `vllm:cache_config_info` (value 1; every field a label, among them
  `num_gpu_blocks` and `block_size`), one series per engine.
- Tokens per second: the counters `vllm:prompt_tokens_total` and
  `vllm:generation_tokens_total` (labels `model_name`, `engine`), read twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric

CACHE_CONFIG_INFO = "vllm:cache_config_info"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"


def _int_label(value: str | None) -> int | None:
    try:
        number = int(value) if value is not None else None
    except ValueError:
        return None  # e.g. "None" before vLLM has profiled the cache
    return number if number is not None and number > 0 else None


def kv_capacity_tokens(families: Iterable[Metric]) -> int | None:
    """num_gpu_blocks x block_size, summed over engines; None if the page does not say."""
    per_engine: dict[str, int] = {}
    for family in families:
        if family.name != CACHE_CONFIG_INFO:
            continue
        for sample in family.samples:
            if sample.value == 0:
                continue
            blocks = _int_label(sample.labels.get("num_gpu_blocks"))
            size = _int_label(sample.labels.get("block_size"))
            if blocks is not None and size is not None:
                per_engine[sample.labels.get("engine", "")] = blocks * size
    return sum(per_engine.values()) if per_engine else None


@dataclass(frozen=True, slots=True)
class CounterReading:
    at: float  # clock.monotonic() when the page was read
    prompt_tokens: float
    generation_tokens: float


@dataclass(frozen=True, slots=True)
class TokenRate:
    prompt_per_second: float
    generation_per_second: float

    @property
    def total_per_second(self) -> float:
        return self.prompt_per_second + self.generation_per_second


def read_counters(families: Iterable[Metric], model: str | None, at: float) -> CounterReading | None:
    """The two token counters, summed over engines; series naming another model are skipped."""
    totals = {PROMPT_TOKENS: 0.0, GENERATION_TOKENS: 0.0}
    found = False
    for family in families:
        for sample in family.samples:
            if sample.name not in totals:
                continue
            named = sample.labels.get("model_name")
            if model is not None and named is not None and named != model:
                continue
            totals[sample.name] += sample.value
            found = True
    if not found:
        return None
    return CounterReading(at=at, prompt_tokens=totals[PROMPT_TOKENS], generation_tokens=totals[GENERATION_TOKENS])


def token_rate(earlier: CounterReading, later: CounterReading) -> TokenRate | None:
    """Tokens per second between two readings; None if no time passed or a counter went
    backwards (the server restarted: the next pair of readings gives a rate again)."""
    elapsed = later.at - earlier.at
    prompt = later.prompt_tokens - earlier.prompt_tokens
    generation = later.generation_tokens - earlier.generation_tokens
    if elapsed <= 0 or prompt < 0 or generation < 0:
        return None
    return TokenRate(prompt_per_second=prompt / elapsed, generation_per_second=generation / elapsed)
