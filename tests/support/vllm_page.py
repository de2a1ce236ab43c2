"""A realistic vLLM /metrics page (~100 KB, nearly all histogram buckets).

The parser and scraper tests use `vllm_metrics_page` as their fixture, and
benchmarks/picking.py times the parser on it, so the page stays honest.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

# Bucket edges as vLLM (v1 engine, prometheus_client) exports them.
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
HTTP_HIGHR_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
                      3.0, 3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0)

HISTOGRAMS: tuple[tuple[str, str, Sequence[float]], ...] = (
    ("iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_BUCKETS),
    ("request_prompt_tokens", "Number of prefill tokens processed.", TOKEN_BUCKETS),
    ("request_generation_tokens", "Number of generation tokens processed.", TOKEN_BUCKETS),
    ("request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
     TOKEN_BUCKETS),
    ("request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20)),
    ("request_params_max_tokens", "Histogram of the max_tokens request parameter.", TOKEN_BUCKETS),
    ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    ("time_per_output_token_seconds", "Histogram of time per output token in seconds.", ITL_BUCKETS),
    ("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
     ITL_BUCKETS),
    ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", LATENCY_BUCKETS),
    ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", LATENCY_BUCKETS),
    ("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
     LATENCY_BUCKETS),
    ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", LATENCY_BUCKETS),
    ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", LATENCY_BUCKETS),
)
HANDLERS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/v1/responses",
            "/tokenize", "/detokenize", "/health", "/ping", "/load", "/version", "/metrics")


def _le(edge: float) -> str:
    return repr(float(edge))


def _process_block(rng: random.Random) -> list[str]:
    out = []
    for gen in range(3):
        out.append(f'python_gc_objects_collected_total{{generation="{gen}"}} {rng.randint(100, 90000)}.0')
    out += [
        "# HELP process_virtual_memory_bytes Virtual memory size in bytes.",
        "# TYPE process_virtual_memory_bytes gauge",
        f"process_virtual_memory_bytes {rng.randint(10**10, 10**11)}.0",
        "# HELP process_resident_memory_bytes Resident memory size in bytes.",
        "# TYPE process_resident_memory_bytes gauge",
        f"process_resident_memory_bytes {rng.randint(10**9, 10**10)}.0",
        "# HELP process_open_fds Number of open file descriptors.",
        "# TYPE process_open_fds gauge",
        f"process_open_fds {rng.randint(50, 500)}.0",
        "# HELP process_max_fds Maximum number of open file descriptors.",
        "# TYPE process_max_fds gauge",
        "process_max_fds 1048576.0",
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {rng.uniform(1.7e9, 1.8e9):.2f}",
        "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.",
        "# TYPE process_cpu_seconds_total counter",
        f"process_cpu_seconds_total {rng.uniform(0, 1e6):.2f}",
    ]
    return out


def _http_block(rng: random.Random) -> list[str]:
    out = ["# HELP http_requests_total Total number of requests by method, status and handler.",
           "# TYPE http_requests_total counter"]
    for handler in HANDLERS:
        for status in ("2xx", "4xx", "5xx"):
            out.append(f'http_requests_total{{handler="{handler}",method="POST",status="{status}"}} '
                       f"{rng.randint(0, 10**6)}.0")
    for kind in ("request", "response"):
        out += [f"# HELP http_{kind}_size_bytes Content length of incoming requests by handler.",
                f"# TYPE http_{kind}_size_bytes summary"]
        for handler in HANDLERS:
            out.append(f'http_{kind}_size_bytes_count{{handler="{handler}"}} {rng.randint(0, 10**6)}.0')
            out.append(f'http_{kind}_size_bytes_sum{{handler="{handler}"}} {rng.randint(0, 10**9)}.0')
    out += ["# HELP http_request_duration_highr_seconds Latency with many buckets but no API specific labels.",
            "# TYPE http_request_duration_highr_seconds histogram"]
    total = 0
    for edge in HTTP_HIGHR_BUCKETS:
        total += rng.randint(0, 5000)
        out.append(f'http_request_duration_highr_seconds_bucket{{le="{_le(edge)}"}} {total}.0')
    out += [f'http_request_duration_highr_seconds_bucket{{le="+Inf"}} {total}.0',
            f"http_request_duration_highr_seconds_count {total}.0",
            f"http_request_duration_highr_seconds_sum {rng.uniform(0, 1e6):.6f}",
            "# HELP http_request_duration_seconds Latency with only few buckets by handler.",
            "# TYPE http_request_duration_seconds histogram"]
    for handler in HANDLERS:
        total = 0
        for edge in (0.1, 0.5, 1.0):
            total += rng.randint(0, 5000)
            out.append(f'http_request_duration_seconds_bucket{{handler="{handler}",le="{_le(edge)}",'
                       f'method="POST"}} {total}.0')
        out.append(f'http_request_duration_seconds_bucket{{handler="{handler}",le="+Inf",method="POST"}} {total}.0')
        out.append(f'http_request_duration_seconds_count{{handler="{handler}",method="POST"}} {total}.0')
        out.append(f'http_request_duration_seconds_sum{{handler="{handler}",method="POST"}} {rng.uniform(0, 1e5):.4f}')
    return out


def _gauge(out: list[str], name: str, help_text: str, values: dict[str, float]) -> None:
    out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
    out += [f"{name}{{{labels}}} {value!r}" for labels, value in values.items()]


def vllm_metrics_page(
    model: str = "/models/meta-llama/Llama-3.3-70B-Instruct",
    waiting: Sequence[float] = (3.0, 4.0),
    running: Sequence[float] = (20.0, 22.0),
    kv: Sequence[float] = (0.25, 0.35),
    *,
    other_model: str | None = None,
    old_kv_name: bool = False,
    seed: int = 0,
) -> str:
    """A vLLM /metrics page with one engine per entry of `waiting`.

    With the defaults it is about 100 KB, mostly histograms, like a real page
    from a busy two-engine server. `other_model` adds a second model's series
    (as a multi-model server would) with large values that must be ignored.
    """
    rng = random.Random(seed)
    models = [(model, waiting, running, kv)]
    if other_model is not None:
        models.append((other_model, (500.0,) * len(waiting), (500.0,) * len(waiting), (1.0,) * len(waiting)))
    series = [(f'engine="{e}",model_name="{m}"', m, e) for m, w, _, _ in models for e in range(len(w))]
    out = _process_block(rng) + _http_block(rng)

    def per_engine(pick: int) -> dict[str, float]:
        return {label: float(models[[m for m, *_ in models].index(m)][pick][e]) for label, m, e in series}

    _gauge(out, "vllm:num_requests_running", "Number of requests in model execution batches.", per_engine(2))
    _gauge(out, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", per_engine(1))
    kv_name = "vllm:gpu_cache_usage_perc" if old_kv_name else "vllm:kv_cache_usage_perc"
    _gauge(out, kv_name, "KV-cache usage. 1 means 100 percent usage.", per_engine(3))
    for counter in ("num_preemptions", "prompt_tokens", "generation_tokens", "prefix_cache_queries",
                    "prefix_cache_hits"):
        out += [f"# HELP vllm:{counter}_total Cumulative count.", f"# TYPE vllm:{counter}_total counter"]
        out += [f"vllm:{counter}_total{{{label}}} {rng.randint(0, 10**8)}.0" for label, _, _ in series]
    out += ["# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter"]
    for label, _, _ in series:
        for reason in ("stop", "length", "abort"):
            out.append(f'vllm:request_success_total{{{label},finished_reason="{reason}"}} {rng.randint(0, 10**5)}.0')
    for name, help_text, buckets in HISTOGRAMS:
        out += [f"# HELP vllm:{name} {help_text}", f"# TYPE vllm:{name} histogram"]
        for label, _, _ in series:
            total = 0
            for edge in buckets:
                total += rng.randint(0, 2000)
                out.append(f'vllm:{name}_bucket{{{label},le="{_le(edge)}"}} {total}.0')
            out.append(f'vllm:{name}_bucket{{{label},le="+Inf"}} {total}.0')
            out.append(f"vllm:{name}_count{{{label}}} {total}.0")
            out.append(f"vllm:{name}_sum{{{label}}} {rng.uniform(0, 1e6)!r}")
    out += ["# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge",
            f'vllm:lora_requests_info{{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""}} '
            f"{rng.uniform(1.7e9, 1.8e9)!r}"]
    out += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
            'gpu_memory_utilization="0.9",num_gpu_blocks="27000",swap_space="4"} 1.0']
    return "\n".join(out) + "\n"
