"""What one `UsageLog.emit` costs the event loop: `python -m modeldock.usage.bench [N] [DIR]`.

Writes N records (default 100,000) to DIR (default a new temp dir) with the default config
(fsync each second on the background thread, 64 MiB files) and prints the mean and
percentiles of the time each call took, plus the record encoding alone.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from modeldock.clock import SystemClock
from modeldock.usage.config import UsageConfig
from modeldock.usage.log import UsageLog
from modeldock.usage.record import UsageRecord, new_request_id


def main(argv: list[str]) -> int:
    count = int(argv[0]) if argv else 100_000
    directory = Path(argv[1]) if len(argv) > 1 else Path(tempfile.mkdtemp(prefix="usage-bench-"))
    clock = SystemClock()
    usage = UsageLog.open(UsageConfig(path=directory / "usage.jsonl", replica="bench"), clock, CollectorRegistry())
    records = [
        UsageRecord(ts=clock.time(), request_id=new_request_id(), tenant=f"tenant-{i % 20}", model="llama-8b",
                    served_model="meta-llama/Llama-3.1-8B-Instruct", endpoint="10.0.0.7:8000",
                    prompt_tokens=500 + i % 700, completion_tokens=i % 300, token_source="reported", status=200,
                    client_request_id=new_request_id(), replica="bench")
        for i in range(count)
    ]
    samples: list[float] = []
    started = time.perf_counter()
    for item in records:
        t0 = time.perf_counter()
        usage.emit(item)
        samples.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - started
    usage.close()
    t0 = time.perf_counter()
    for item in records[:10_000]:
        item.to_json()
    encode = (time.perf_counter() - t0) / min(count, 10_000)
    samples.sort()
    q = statistics.quantiles(samples, n=1000)
    print(f"{count} records to {directory}: mean {elapsed / count * 1e6:.1f} us/record "
          f"(encode {encode * 1e6:.1f} us), p50 {q[499] * 1e6:.1f} us, p99 {q[989] * 1e6:.1f} us, "
          f"p99.9 {q[998] * 1e6:.1f} us, max {samples[-1] * 1e6:.0f} us; "
          f"{(directory / 'usage.bench.jsonl').stat().st_size / count:.0f} bytes/record")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
