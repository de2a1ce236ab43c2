"""vLLM's Prometheus metrics, same names, labels and buckets, in a registry of our own.

Each simulator has its own CollectorRegistry, so several can run in one process.
Gauges are read from the engine when /metrics is scraped, so they always match it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from modeldock.sim.config import SimConfig
from modeldock.sim.engine import Engine, StepResult

# Bucket edges copied from vLLM's PrometheusStatLogger (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
FINISH_REASONS = ("stop", "length", "abort")
LABELS = ("model_name", "engine")


def one_two_five_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`, as vLLM's build_1_2_5_buckets."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(float(mantissa * scale))
        scale *= 10


class SimMetrics:
    def __init__(self, config: SimConfig) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = (config.model, "0")
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=reg)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.").labels(
            *labels
        )
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.").labels(
            *labels
        )
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").labels(
            *labels
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        ).labels(*labels)
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(*labels)
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.").labels(
            *labels
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*labels)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.").labels(
            *labels
        )
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=reg,
        )
        self.success = {reason: success.labels(*labels, reason) for reason in FINISH_REASONS}

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        ).labels(*labels)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS
        ).labels(*labels)
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. DEPRECATED: use vllm:inter_token_latency_seconds.",
            TOKEN_LATENCY_BUCKETS,
        ).labels(*labels)
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        ).labels(*labels)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        ).labels(*labels)
        length_buckets = one_two_five_buckets(config.max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", length_buckets
        ).labels(*labels)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", length_buckets
        ).labels(*labels)

        # vLLM exports its CacheConfig as an info-style gauge fixed at 1.
        info = {
            "block_size": str(config.block_size),
            "num_gpu_blocks": str(config.num_gpu_blocks),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "cache_dtype": "auto",
            "engine": "0",
        }
        Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", tuple(info), registry=reg
        ).labels(**info).set(1)

    def record_step(self, step: StepResult) -> None:
        if step.prefix_queries:
            self.prefix_queries.inc(step.prefix_queries)
            self.prefix_hits.inc(step.prefix_hits)
        if step.preempted:
            self.preemptions.inc(len(step.preempted))
        if step.prompt_tokens:
            self.prompt_tokens.inc(step.prompt_tokens)
        if step.outputs:
            self.generation_tokens.inc(len(step.outputs))

    def render(self, engine: Engine) -> bytes:
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.kv_usage.set(engine.kv_usage)
        return generate_latest(self.registry)
