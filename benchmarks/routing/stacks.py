"""Stack setup for the routing benchmark: the simulator flags, the routing config per contender, the
workloads from the command line, and the plain-HTTP probes of the simulators (`/sim/stats`, `/metrics`)
that the runs use to wait for idle and to count."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

from benchmarks.routing.driver import DriveResult, drive
from benchmarks.routing.workloads import WORKLOADS, Request, Workload
from modeldock.devstack.stack import wait_until

MODEL = "demo-model"


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 (loopback)
        return json.loads(resp.read())



def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 (loopback)
        body: bytes = resp.read()
        return body.decode()



def sim_stats(urls: Sequence[str]) -> list[dict[str, Any]]:
    return [get_json(f"{u}/sim/stats") for u in urls]



def wait_idle(urls: Sequence[str], settle: float) -> None:
    """Every simulator has nothing running or queued; then `settle` seconds so the gateway's
    scraper (every 0.5 s) has seen them idle."""
    wait_until(lambda: all(s["running"] == 0 and s["waiting"] == 0 for s in sim_stats(urls)), 120, 0.1,
               "simulators idle")
    time.sleep(settle)



async def drive_model(url: str, token: str | None, requests: Sequence[Request], speed: float) -> DriveResult:
    return await drive(url, MODEL, token, requests, speed)



def warm(url: str, token: str | None) -> None:
    """A few tiny requests so connections and scrape samples exist before measuring (their prompts
    share nothing with any workload's, so they leave nothing useful in the prefix cache)."""
    asyncio.run(drive_model(url, token, [Request(i, 0.0, "warm", ({"role": "user", "content": f"warm-up {i}"},), 4, 3)
                                    for i in range(8)], 1.0))



def sim_args(args: argparse.Namespace) -> list[str]:
    return ["--speed", f"{args.speed:g}", "--max-num-seqs", str(args.max_num_seqs),
            "--num-gpu-blocks", str(args.num_gpu_blocks), "--max-model-len", "8192"]



def with_routing(routing: dict[str, Any]) -> Any:
    def edit(data: dict[str, Any], _sims: Any) -> None:
        data["routing"] = routing
    return edit



def with_policy(policy: str) -> Any:
    return with_routing({"policy": policy})



def build_workloads(args: argparse.Namespace) -> list[Workload]:
    k = args.length_scale
    short, long_ = max(1, round(64 * k)), max(1, round(2000 * k))
    scale = args.duration_scale
    built = {
        "mixed": WORKLOADS["mixed"](args.seed, duration=18.0 * scale, rate=args.mixed_rate * 0.5 / k,
                                    warmup=6.0 * k / 0.5,
                                    short_tokens=short, long_tokens=long_),
        "bursts": WORKLOADS["bursts"](args.seed, duration=15.0 * scale),
        "shared": WORKLOADS["shared"](args.seed, duration=12.0 * scale),
    }
    return [built[name] for name in args.workloads]

