"""The overload benchmark over several replicas: the client's routing and fail-over
(benchmarks/overload/phases.py, against in-process fake servers) and the report's class, ratio,
replica, kill and Redis-down tables (benchmarks/overload/report_replicas.py, from hand-made results)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from bench_fake_server import FakeOpenAI, Script

from benchmarks.overload import report_replicas
from benchmarks.overload.phases import Event, Sent, kill_summary, open_loop
from benchmarks.overload.plan import TENANTS
from benchmarks.overload.report import body
from benchmarks.routing.driver import Timed
from benchmarks.routing.workloads import Request
from modeldock.bench.metrics import RequestRecord

StartServer = Callable[..., Awaitable[FakeOpenAI]]
MAIN, BOB = TENANTS[0], TENANTS[2]


def requests(*offsets: float) -> list[Request]:
    return [Request(i, at, "short", ({"role": "user", "content": f"hello {i}"},), 4, 4)
            for i, at in enumerate(offsets)]


# -- the client ---------------------------------------------------------------------------------


async def test_round_robin_fixed_routes_and_failover(start_server: StartServer) -> None:
    fast = Script(ttft_delay=0.01, gap=0.0, pieces=1)
    a, b = await start_server(fast), await start_server(fast)
    urls = [a.base_url, b.base_url]
    _, sent = await asyncio.wait_for(open_loop(urls, [True, True], [(MAIN, requests(*[0.0] * 6), None),
                                                                    (BOB, requests(0.0, 0.0), 1)], 10.0), 20)
    assert (a.arrivals, b.arrivals) == (3, 5)  # main alternates, bob always through replica 1
    assert sorted(s.replica for s in sent if s.tenant == "main") == [0, 0, 0, 1, 1, 1]
    assert all(s.timed.record.error is None for s in sent)
    # Replica 0 down: every arrival, its own too, goes to the live replica.
    _, sent = await asyncio.wait_for(open_loop(urls, [False, True], [(MAIN, requests(*[0.0] * 4), None)], 10.0), 20)
    assert (a.arrivals, b.arrivals) == (3, 9) and {s.replica for s in sent} == {1}


async def test_an_event_takes_a_replica_out_mid_schedule(start_server: StartServer) -> None:
    fast = Script(ttft_delay=0.01, gap=0.0, pieces=1)
    a, b = await start_server(fast), await start_server(fast)
    live = [True, True]

    def kill() -> None:
        live[0] = False

    event = Event(0.4, "kill", kill)
    # Arrivals 0 and 2 are replica 0's: the one before the event goes there, the one after fails over.
    _, sent = await asyncio.wait_for(open_loop([a.base_url, b.base_url], live, [(MAIN, requests(0.0, 0.0, 0.9), None)],
                                               10.0, [event]), 20)
    assert [s.replica for s in sorted(sent, key=lambda s: s.timed.request.index)] == [0, 1, 1]
    assert (a.arrivals, b.arrivals) == (1, 2)
    assert event.done_at is not None and 0.4 <= event.done_at < 0.9


def sent(replica: int, at: float, error: str | None) -> Sent:
    record = RequestRecord(index=0, sent_at=at, error=error)
    return Sent("main", replica, Timed(requests(at)[0], record, 0.0, at))


def test_kill_summary_counts_the_killed_replicas_failures_apart() -> None:
    log = [sent(1, 0.5, "stream_cut"), sent(1, 1.0, None), sent(1, 2.9, "connection"), sent(0, 2.9, "connection"),
           sent(0, 1.0, None), sent(1, 3.5, "timeout"),  # sent to it after it was gone
           sent(0, 4.0, "429"), sent(1, 2.0, "429")]  # shed: counted apart, never as a failure
    pre = [(-0.1, 10.0), (1.0, 12.0), (2.0, 12.0), (3.0, 15.0), (4.0, 21.0), (6.0, 22.0)]
    s = kill_summary(log, victim=1, kill_at=3.0, killed_at=3.1, pre=pre, after_s=2.0)
    assert (s["failed_at_kill"], s["sent_to_victim_before"], s["failed_other"], s["r429_other"]) == (2, 4, 2, 1)
    assert s["preemptions_before"] == 3.0  # 12 at 1.0 -> 15 at 3.0
    assert s["preemptions_after"] == 6.0  # 15 at 3.0 -> 21 at 4.0 (the last sample by 5.0)


# -- the report ---------------------------------------------------------------------------------


def agg(p95: float | None, p99: float | None = None, *, served: float = 100.0, e2e: float | None = None,
        offered: int = 100) -> dict[str, Any]:
    return {"offered": offered, "served": round(offered * served / 100), "served_pct": served, "r429": 0,
            "r429_pct": 0.0, "r429_clean": 0, "r429_unclean": 0, "r429_unchecked": 0, "other_errors": {},
            "ttft_p50": p95, "ttft_p95": p95, "ttft_p99": p99 if p99 is not None else p95, "e2e_p50": e2e,
            "e2e_p95": e2e}


def run(all_: dict[str, Any], *, preemptions: float = 0.0, **extra: Any) -> dict[str, Any]:
    return {"all": all_, "tenants": {"main": all_}, "preemptions": preemptions, "wall_s": 10.0,
            "extproc_cpu_s": 1.0, "extproc_idle_cpu_per_s": 0.0, "load1": 1.0, "ttft_p95_ci": {}, **extra}


def pair(who: str, alone: dict[str, Any], both: dict[str, Any], alone_cls: dict[str, Any],
         both_cls: dict[str, Any]) -> dict[str, Any]:
    return {"alone": run(alone, tenants={who: alone}, tenant_classes={who: alone_cls}),
            "both": run(both, tenants={who: both}, tenant_classes={who: both_cls})}


def saved(runs: dict[str, Any], first: dict[str, Any]) -> dict[str, Any]:
    return {"args": {"kill_load": 1.0, "kill_s": 30, "redis_down_s": 30}, "results": first, "runs": runs}


def row(text: str, *cells: str) -> str:
    """The one table row holding every cell."""
    rows = [line for line in text.splitlines() if all(f"| {c} |" in line for c in cells)]
    assert len(rows) == 1, (cells, text)
    return rows[0]


def test_ratios_per_class_and_pooled_against_the_targets() -> None:
    noisy = pair("bob", agg(1.0), agg(1.8), {"short": agg(0.1), "long": agg(2.0)},
                 {"short": agg(0.14), "long": agg(3.6)})
    priority = pair("ivy", agg(0.1), agg(0.12), {"short": agg(0.1)}, {"short": agg(0.12)})
    first = {"queue": {"noisy": noisy, "priority": priority}}
    text = report_replicas.section_ratios(saved({"1": {"replicas": 1, "redis": False}}, first))
    line = row(text, "`queue`")
    assert "| 1.40x | 1.80x | 1.80x | NOT met |" in line  # the long class and the pool break 1.5x
    assert "| 1.20x | - | 1.20x | met |" in line  # interactive: short answers only
    classes = report_replicas.section_classes(saved({"1": {"replicas": 1, "redis": False}}, first))
    assert "| 100 / 100 | 2000 / 2000 | 1000 / 1000 |" in row(classes, "noisy: B alone")
    assert "| 140 / 140 | 3600 / 3600 | 1800 / 1800 |" in row(classes, "noisy: B with the flood")


def test_replica_runs_are_judged_against_one_replica_on_the_same_schedule() -> None:
    one = {"noqueue": {"overload": {"rate": 19.0, "run": run(agg(3.0, e2e=9.0), preemptions=50)}},
           "queue": {"overload": {"rate": 19.0, "run": run(agg(0.5, e2e=4.0, served=88.0), preemptions=0)}}}
    two = {"queue": {"overload": {"rate": 19.0, "run": run(agg(0.8, e2e=6.0, served=90.0), preemptions=3)}}}
    three = {"queue": {"overload": {"rate": 19.0, "run": run(agg(1.2, e2e=4.4, served=80.0), preemptions=8)}}}
    runs = {"1": {"replicas": 1, "redis": False}, "2": {"replicas": 2, "redis": True, "results": two},
            "3": {"replicas": 3, "redis": True, "results": three}}
    text = report_replicas.section_replicas(saved(runs, one))
    r2 = row(text, "2", "`queue`")
    assert "| 90.0% met | 800 met | 3 (0.06x of noqueue) met | 6000 (1.50x) NOT met |" in r2
    r3 = row(text, "3", "`queue`")
    assert "| 80.0% NOT met | 1200 NOT met | 8 (0.16x of noqueue) NOT met | 4400 (1.10x) met |" in r3
    assert "| 88.0% - | 500 - |" in row(text, "1", "`queue`")  # one replica: the reference, not judged


def test_kill_and_redis_down_tables() -> None:
    kill = {"rate": 16.0, "run": run(agg(0.4, served=97.0), preemptions=4), "victim": 1, "after_s": 5.0,
            "failed_at_kill": 3, "sent_to_victim_before": 70, "failed_other": 0, "r429_other": 5,
            "preemptions_before": 0.0,
            "preemptions_after": 2.0, "in_flight_end": [0.0, 1.0]}
    clean = {**kill, "in_flight_end": [0.0, 0.0]}
    down = {"rate": 16.0, "run": run(agg(0.4), preemptions=1), "failed": 0, "r429": 4, "recovery_s": [0.4, 3.1],
            "peers_exported": True}
    missing = {**down, "failed": 2, "recovery_s": None, "peers_exported": False}
    runs = {"2": {"replicas": 2, "redis": True}, "3": {"replicas": 3, "redis": True,
                                                       "results": {"queue": {"kill": clean, "redis_down": missing}}}}
    s = saved(runs, {"queue": {"kill": kill, "redis_down": down}})
    text = report_replicas.section_kill(s)
    assert "| r1 | 3/70 | 0 | 5 | 0 / 2 | 4 | 97.0% | 0, 1 NOT met |" in row(text, "2", "`queue`")
    assert "| 0, 0 met |" in row(text, "3", "`queue`")
    text = report_replicas.section_redis_down(s)
    assert "| 0 met | 4 | 100.0% | 1 | 0.4, 3.1 NOT met |" in row(text, "2", "`queue`")
    assert "| 2 NOT met | 4 | 100.0% | 1 | - |" in row(text, "3", "`queue`")


def test_a_one_run_result_saved_before_classes_still_renders() -> None:
    old = {"queue": {"overload": {"rate": 19.0, "run": run(agg(0.5, e2e=4.0), preemptions=0)}}}
    text = report_replicas.section_classes({"results": old})
    assert "| overload | - | - | 500 / 500 |" in row(text, "`queue`")
    assert report_replicas.section_replicas({"results": old}) == ""  # one run: nothing to compare
    assert report_replicas.section_kill({"results": old}) == ""
    whole = {"args": {"backends": 3, "max_num_seqs": 4, "num_gpu_blocks": 112, "speed": 1.0, "slow_factor": 0.5,
                      "cap_duration": 34, "cap_warmup": 4, "overload": 1.15, "overload_s": 30, "learn_limit": False},
             "mix": {"long_fraction": 0.2, "short_tokens": 32, "long_tokens": 256, "prompt_tokens": [64, 512]},
             "capacity": {"rate": 16.0, "concurrency": 12, "completed": 480, "window_s": 30, "ttft_p95": 0.3},
             "capacity_measured_on": "queue", "configs": [{"name": "queue", "description": "d", "tenant_fields": True,
                                                           "yaml": {}}],
             "results": old, "elapsed_s": 60.0}
    assert "Per request class" in body(whole)
