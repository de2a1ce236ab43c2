"""How soon an endpoint added to a model's Service takes its first request, first scrape included.

The real stack (modeldock.devstack: simulators, `modeldock xds`, ext_proc, Envoy) with `demo-model`
discovered from a FakeKubeServer (tests/support/fake_kube.py) in this process, as tests/e2e/test_discovery.py
does: each simulator has its own port, so each is its own EndpointSlice of Service llm/vllm. The model
starts with one endpoint, kept busy by a few long generations; a few clients send short requests
back to back the whole time. Then, at t0, a spare simulator's slice is applied, and the time until
that simulator logs its first completion request (its own /sim/requests clock) is taken, as is when
Envoy's cluster took the host (its `update_time` stat). The slice is deleted again, the stack settles,
and the next spare is added; the spares take turns.

    .venv/bin/python -m benchmarks.xds_first_request             # writes the xds-first-request section
    .venv/bin/python -m benchmarks.xds_first_request --no-write --changes 5
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks._report import table, write_section
from modeldock.bench.stats import nearest_rank
from modeldock.devstack.stack import API_KEY, Sim, Stack, running_stack, wait_until
from modeldock.types import cluster_name

COMMAND = ".venv/bin/python -m benchmarks.xds_first_request"
NAMESPACE, SERVICE, PORT_NAME, MODEL = "llm", "vllm", "http", "demo-model"
STAT = cluster_name(MODEL).replace(":", "_")
# Real-time engine steps of 5 ms: a short request is a few steps, a long one seconds.
SIM_ARGS = ("--step-base-ms", "20", "--speed", "4")
TARGET_MS = 200


def slice_of(sim: Sim) -> dict[str, Any]:
    from tests.support.fake_kube import make_slice

    return make_slice(f"{SERVICE}-{sim.port}", NAMESPACE, SERVICE, [("127.0.0.1", True, False)], PORT_NAME, sim.port)


def chat(stack: Stack, max_tokens: int, timeout: float) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens}
    req = urllib.request.Request(f"{stack.base_url}/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json", "authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 (loopback)
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def cluster(stack: Stack) -> tuple[int, int]:
    """(membership_change, update_time ms) of the model's Envoy cluster."""
    pattern = urllib.parse.quote(f"^cluster[.]{STAT}[.](membership_change|update_time)$")
    with urllib.request.urlopen(f"{stack.admin_url}/stats?filter={pattern}", timeout=5) as resp:  # noqa: S310
        text = resp.read().decode()
    values = {line.split(": ")[0].rsplit(".", 1)[1]: int(line.split(": ")[1]) for line in text.splitlines()}
    return values.get("membership_change", 0), values.get("update_time", 0)


def first_request(sim: Sim, after: float, timeout: float) -> float | None:
    """The sim's clock time of its first completion request at or after `after`; None if none came."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        times = [r["time"] for r in sim.requests() if r["path"].startswith("/v1/") and r["time"] >= after]
        if times:
            return float(min(times))
        time.sleep(0.005)
    return None


class Load:
    """`long` clients of long generations and `short` clients of one-token requests, back to back."""

    def __init__(self, stack: Stack, long: int, short: int, long_tokens: int) -> None:
        self.stop = threading.Event()
        self.sent = 0
        self.failed: dict[int, int] = {}
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._loop, args=(stack, long_tokens, 60.0), daemon=True)
                        for _ in range(long)]
        self.threads += [threading.Thread(target=self._loop, args=(stack, 1, 10.0), daemon=True) for _ in range(short)]

    def _loop(self, stack: Stack, max_tokens: int, timeout: float) -> None:
        while not self.stop.is_set():
            code = chat(stack, max_tokens, timeout)
            with self.lock:
                self.sent += 1
                if code != 200:
                    self.failed[code] = self.failed.get(code, 0) + 1
                    time.sleep(0.05)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(70)


def run(args: argparse.Namespace, interval: float) -> dict[str, Any]:
    from tests.support.fake_kube import FakeKubeServer

    jitter = random.Random(0)
    out: dict[str, Any] = {"first": [], "envoy": [], "missed": 0, "interval": interval}
    with tempfile.TemporaryDirectory(prefix="xds-first-") as tmp, FakeKubeServer() as kube:
        def edit(data: dict[str, Any], sims: list[Sim]) -> None:
            data["models"] = [{"name": MODEL, "kubernetes": {"namespace": NAMESPACE, "service": SERVICE,
                                                             "port": PORT_NAME}}]
            data["routing"] = {"scrape": {"interval_seconds": interval}}
            kube.apply(slice_of(sims[0]))

        kubeconfig = kube.write_kubeconfig(Path(tmp) / "kubeconfig")
        with running_stack(Path(tmp) / "stack", backends=1 + args.spares, sim_args=SIM_ARGS, edit_config=edit,
                           xds_args=("--kubeconfig", str(kubeconfig)), log_level="info") as stack:
            busy, spares = stack.sims[0], stack.sims[1:]
            wait_until(lambda: chat(stack, 1, 5) == 200, 30, what="the gateway to serve a request")
            with Load(stack, args.long, args.short, args.long_tokens) as load:
                wait_until(lambda: busy.stats()["running"] >= args.long, 30, what="the long generations")
                time.sleep(1.0)
                sent0, started = load.sent, time.monotonic()
                for i in range(args.changes):
                    sim = spares[i % len(spares)]
                    count, _ = cluster(stack)
                    t0 = time.time()
                    kube.apply(slice_of(sim))
                    first = first_request(sim, t0, args.timeout)
                    wait_until(lambda c=count: cluster(stack)[0] > c, 10, what="Envoy to take the host")  # type: ignore[misc]
                    count, updated_ms = cluster(stack)
                    out["envoy"].append(updated_ms / 1000 - t0)
                    if first is None:
                        out["missed"] += 1
                    else:
                        out["first"].append(first - t0)
                    print(f"change {i}: first request {'-' if first is None else f'{(first - t0) * 1000:.0f} ms'}, "
                          f"busy running {busy.stats()['running']}", flush=True)
                    kube.delete(NAMESPACE, f"{SERVICE}-{sim.port}")
                    wait_until(lambda c=count: cluster(stack)[0] > c, 10, what="Envoy to drop the host")  # type: ignore[misc]
                    # Not in step with the scraper's rounds: the next t0 lands anywhere in its interval.
                    time.sleep(args.settle + jitter.uniform(0, max(0.5, interval)))
                    urllib.request.urlopen(urllib.request.Request(f"{sim.url}/sim/requests", method="DELETE"),
                                           timeout=5).read()
                out["rate"] = (load.sent - sent0) / (time.monotonic() - started)
                out["busy"] = busy.stats()
            out["failed"] = dict(load.failed)
    return out


def report(outs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    rows: list[list[object]] = []
    verdicts = []
    for out in outs:
        every = f"{out['interval']:g} s"
        for name, values in (("t0 -> Envoy cluster has the host", out["envoy"]),
                             ("t0 -> first request at the new endpoint", out["first"])):
            if values:
                rows.append([every, name, len(values), f"{nearest_rank(values, 50) * 1000:.0f}",
                             f"{nearest_rank(values, 99) * 1000:.0f}", f"{max(values) * 1000:.0f}"])
        first = out["first"]
        p99 = nearest_rank(first, 99) * 1000 if first else float("inf")
        verdict = "meets" if p99 <= TARGET_MS and not out["missed"] else "misses"
        verdicts.append(f"scrape interval {every}: first request p99 {p99:.0f} ms, {verdict} the {TARGET_MS} ms "
                        f"target; {out['missed']} additions got no request within {args.timeout:g} s; "
                        f"{out.get('rate', 0):.0f} requests/s; failed requests: {out.get('failed') or 'none'}")
    return f"""
{args.changes} additions per scrape interval (`routing.scrape.interval_seconds`; 0.5 s is the default).
`demo-model` is discovered from Service {NAMESPACE}/{SERVICE} on the fake API server (one EndpointSlice per
simulator, since each listens on its own port). It starts with one simulator kept busy by {args.long}
back-to-back generations of {args.long_tokens} tokens, while {args.short} clients send one-token requests back
to back through Envoy. At t0 a spare simulator's slice is applied; the first request is the spare's
own log of its first completion request. Then the slice is deleted, Envoy drops the host, and
{args.settle:g} s plus a random 0-0.5 s pass (so t0 falls anywhere in the scraper's cycle) before the next
of {args.spares} spares (in turn) is added. Simulators: `{' '.join(SIM_ARGS)}`; all other settings are the
defaults.

{table(["scrape interval", "stage", "n", "p50 ms", "p99 ms", "max ms"], rows)}

{chr(10).join(f"- {v}" for v in verdicts)}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs/benchmarks.md")
    parser.add_argument("--changes", type=int, default=20, help="endpoints added (and removed again)")
    parser.add_argument("--spares", type=int, default=3, help="spare simulators, added in turn")
    parser.add_argument("--long", type=int, default=4, help="clients of long generations on the busy endpoint")
    parser.add_argument("--long-tokens", type=int, default=1000)
    parser.add_argument("--short", type=int, default=3, help="clients of one-token requests")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds after a removal before the next add")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the first request")
    parser.add_argument("--scrape-intervals", type=lambda t: [float(x) for x in t.split(",")], default=[0.5, 0.1],
                        help="routing.scrape.interval_seconds to run with, each its own stack (default 0.5,0.1)")
    args = parser.parse_args()
    outs = [run(args, interval) for interval in args.scrape_intervals]
    body = report(outs, args)
    print(body)
    if not args.no_write:
        write_section("xds-first-request", "xDS: an added endpoint's first request", COMMAND, body)


if __name__ == "__main__":
    main()
