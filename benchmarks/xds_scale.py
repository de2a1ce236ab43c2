"""What a one-model change costs the xDS server at 1,000 models, incremental against the full build.

In this process, side by side in one run: the control plane as it was before the
incremental build (every change packed a new ResourceSet over all 1,000 Clusters
and assignments, hashed each type's version over every resource, and every delta
stream compared every resource it holds) and as it is now (`ResourceSet.derive`:
only the changed model's assignment is packed and hashed, the type's version moves
by that resource's digest, and a delta stream compares only the names the cache
logged as changed). The earlier code is loaded from git (`--before`, a commit) as
modules of their own, so both run on the same interpreter, snapshots and streams.

One change: one endpoint of one model's list is replaced in the snapshot, then
the builder builds, the cache takes the set, and every stream (subscribed like
Envoy: wildcard CDS, EDS for every cluster, all ACKed) produces its response,
serialized as gRPC would send it. Medians over the changes, rounds interleaved.

    .venv/bin/python -m benchmarks.xds_scale             # writes the xds-scale section of docs/benchmarks.md
    .venv/bin/python -m benchmarks.xds_scale --no-write  # print only
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envoy.service.discovery.v3 import discovery_pb2

from benchmarks._report import table, write_section
from modeldock.clock import FakeClock
from modeldock.config import ModelConfig
from modeldock.discovery.snapshot import SnapshotStore
from modeldock.types import Endpoint, cluster_name
from modeldock.xds import builder as builder_now
from modeldock.xds import cache as cache_now
from modeldock.xds import delta as delta_now
from modeldock.xds.resources import CLUSTER_TYPE, ENDPOINT_TYPE

COMMAND = ".venv/bin/python -m benchmarks.xds_scale"
ROOT = Path(__file__).resolve().parents[1]
BEFORE = "b1281aa"  # the last commit before the incremental build


def load_before(commit: str) -> tuple[Any, Any, Any]:
    """The builder, cache and delta modules as they were at `commit`, importing each other."""
    loaded: dict[str, types.ModuleType] = {}
    for name in ("cache", "builder", "delta"):
        source = subprocess.run(["git", "show", f"{commit}:modeldock/xds/{name}.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
        for other in loaded:
            source = source.replace(f"from modeldock.xds.{other} import", f"from _before_{other} import")
        module = types.ModuleType(f"_before_{name}")
        sys.modules[module.__name__] = module  # dataclasses look the module up by name
        exec(compile(source, f"{commit}:modeldock/xds/{name}.py", "exec"), module.__dict__)  # noqa: S102
        loaded[name] = module
    return loaded["builder"], loaded["cache"], loaded["delta"]


@dataclass
class Cost:
    build: float  # builder.build + cache.set, seconds
    streams: float  # every stream's on_change + serialization, seconds
    eds_bytes: int  # one stream's EDS response


def endpoints(model: int, per_model: int, gen: int) -> list[Endpoint]:
    first = Endpoint(f"10.200.{gen // 250 % 250}.{gen % 250 + 1}", 8000)
    return [first] + [Endpoint(f"10.{model // 250}.{model % 250}.{k + 2}", 8000) for k in range(per_model - 1)]


class Plane:
    """One control plane (before or now): a builder, a cache, and `streams` delta streams on it."""

    def __init__(self, modules: tuple[Any, Any, Any], models: int, per_model: int, streams: int) -> None:
        builder_mod, cache_mod, delta_mod = modules
        self.clock = FakeClock()
        self.store = SnapshotStore(self.clock)
        configs = [ModelConfig(name=f"m{i:04d}", endpoints=[]) for i in range(models)]
        for i in range(models):
            self.store.update(f"m{i:04d}", endpoints(i, per_model, 0))
        self.builder = builder_mod.ResourceBuilder(configs, 15)
        self.cache = cache_mod.ResourceCache()
        self.cache.set(self.builder.build(self.store.current, self.clock.monotonic()))
        names = [cluster_name(c.name) for c in configs]
        self.streams = [delta_mod.DeltaStream(self.cache) for _ in range(streams)]
        for stream in self.streams:
            for request in (discovery_pb2.DeltaDiscoveryRequest(type_url=CLUSTER_TYPE),
                            discovery_pb2.DeltaDiscoveryRequest(type_url=ENDPOINT_TYPE,
                                                                resource_names_subscribe=names)):
                for response in stream.on_request(request):
                    self._ack(stream, response)

    @staticmethod
    def _ack(stream: Any, response: discovery_pb2.DeltaDiscoveryResponse) -> None:
        stream.on_request(discovery_pb2.DeltaDiscoveryRequest(type_url=response.type_url,
                                                              response_nonce=response.nonce))

    def change(self, model: int, per_model: int, gen: int) -> Cost:
        self.store.update(f"m{model:04d}", endpoints(model, per_model, gen))
        start = time.perf_counter()
        self.cache.set(self.builder.build(self.store.current, self.clock.monotonic()))
        built = time.perf_counter()
        eds = 0
        responses = []
        for stream in self.streams:
            out = stream.on_change()
            for response in out:
                data = response.SerializeToString()
                if response.type_url == ENDPOINT_TYPE and not eds:
                    eds = len(data)
            responses.append(out)
        done = time.perf_counter()
        for stream, out in zip(self.streams, responses, strict=True):
            for response in out:
                self._ack(stream, response)
        return Cost(built - start, done - built, eds)


def measure(before: tuple[Any, Any, Any], models: int, per_model: int, streams: int,
            changes: int) -> dict[str, list[Cost]]:
    planes = {"before": Plane(before, models, per_model, streams),
              "now": Plane((builder_now, cache_now, delta_now), models, per_model, streams)}
    costs: dict[str, list[Cost]] = {name: [] for name in planes}
    for i in range(changes):
        for name in (("before", "now") if i % 2 else ("now", "before")):  # interleaved, order alternating
            costs[name].append(planes[name].change(i * 7 % models, per_model, i + 1))
    return costs


def median(costs: list[Cost], part: Callable[[Cost], float]) -> float:
    return statistics.median(part(c) for c in costs)


def report(rows: list[tuple[str, dict[str, list[Cost]]]], changes: int, commit: str) -> str:
    lines = []
    for shape, costs in rows:
        b, n = costs["before"], costs["now"]
        build_b, build_n = median(b, lambda c: c.build), median(n, lambda c: c.build)
        push_b, push_n = median(b, lambda c: c.streams), median(n, lambda c: c.streams)
        tot_b, tot_n = median(b, lambda c: c.build + c.streams), median(n, lambda c: c.build + c.streams)
        lines.append([shape, f"{build_b * 1000:.2f}", f"{build_n * 1000:.3f}", f"{build_n / build_b:.3f}",
                      f"{push_b * 1000:.2f}", f"{push_n * 1000:.2f}", f"{push_n / push_b:.3f}",
                      f"{tot_n / tot_b:.3f}", n[0].eds_bytes])
    body = table(["models x endpoints, streams", "build before ms", "build now ms", "build now / before",
                  "all streams before ms", "all streams now ms", "streams now / before", "total now / before",
                  "EDS bytes per stream"], lines)
    return f"""
{changes} one-model changes per shape, before ({commit}, loaded from git) and now interleaved in one
process. Build: `ResourceBuilder.build` + `ResourceCache.set`. All streams: every delta stream's
`on_change` and the serialization of its response. Medians.

{body}

Before, a change to one of 1,000 models cost a build over every resource (each type's version a hash
over all 1,000 names) and, per stream, a comparison of all 1,000 assignments it holds. Now both are
O(changed): the version is a sum of per-resource digests, moved by the one replaced resource, and each
stream compares only the names the cache logged since the set it last compared. What is sent is the
same (one assignment, the same bytes), which tests/unit/core/test_xds_incremental.py checks against a
full comparison on random changes, subscriptions and NACKs.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs/benchmarks.md")
    parser.add_argument("--changes", type=int, default=200)
    parser.add_argument("--before", default=BEFORE, help="the commit to compare against")
    parser.add_argument("--shapes", default="1000x10:10,1000x10:50,100x100:10",
                        help="models x endpoints per model : delta streams, comma-separated")
    args = parser.parse_args()
    before = load_before(args.before)
    rows = []
    for shape in args.shapes.split(","):
        dims, streams = shape.split(":")
        models, per_model = (int(x) for x in dims.split("x"))
        costs = measure(before, models, per_model, int(streams), args.changes)
        rows.append((f"{models} x {per_model}, {streams}", costs))
        print(f"{shape}: done", flush=True)
    body = report(rows, args.changes, args.before)
    print(body)
    if not args.no_write:
        write_section("xds-scale", "xDS at 1,000 models: a one-model change, incremental against full", COMMAND,
                      body)


if __name__ == "__main__":
    main()
