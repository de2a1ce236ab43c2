"""An honest load generator for OpenAI-compatible streaming endpoints.

`run_benchmark(BenchOptions(...))` runs in-process; `modeldock bench` is the CLI.
Metric definitions are in README.md next to this file.
"""

from modeldock.bench.metrics import RequestRecord
from modeldock.bench.results import BenchOptions, BenchResult, TierParams, TierResult
from modeldock.bench.runner import Progress, run_benchmark
from modeldock.bench.stats import Summary, nearest_rank, summarize

__all__ = [
    "BenchOptions",
    "BenchResult",
    "Progress",
    "RequestRecord",
    "Summary",
    "TierParams",
    "TierResult",
    "nearest_rank",
    "run_benchmark",
    "summarize",
]
