"""The routing benchmark's pure pieces outside the workloads: pooling runs into report cells, the
affinity reference's route, the number formatting, and the names `--report-from` needs from run.py."""

from __future__ import annotations

import pickle

import pytest

from benchmarks.routing.driver import Timed
from benchmarks.routing.report import Cell, cells, errors_text, ms, pct
from benchmarks.routing.rotations import Run, by_group
from benchmarks.routing.workloads import Request
from modeldock.bench.metrics import RequestRecord


def _timed(index: int, ttft: float, e2e: float, error: str | None = None, tokens: int = 10) -> Timed:
    record = RequestRecord(index, sent_at=100.0, first_content_at=100.0 + ttft, ended_at=100.0 + e2e,
                           completion_tokens=tokens, error=error)
    request = Request(index, 0.0, "short", ({"role": "user", "content": "x"},), 10, 3)
    return Timed(request, record, late_s=0.0, done_at=100.0 + e2e)


def _run(policy: str, rotation: int, ttfts: list[float], received: list[int], hits: int = 0,
         queries: int = 0, same: float | None = None) -> Run:
    timed = [_timed(i, t, t + 1.0) for i, t in enumerate(ttfts)]
    return Run(policy, rotation, "mixed", timed, wall_s=2.0, cpu_s={"client": 0.5}, load1=1.0, received=received,
               preemptions=0, prefix_queries=queries, prefix_hits=hits, diag={"same_as_previous": same})


def test_cells_pool_rotations_per_policy_and_workload() -> None:
    runs = [_run("default", 0, [0.01, 0.02], [3, 1], hits=1, queries=4, same=0.5),
            _run("default", 1, [0.03, 0.04], [2, 2], hits=3, queries=4, same=None),
            _run("round_robin", 0, [0.5, 0.6], [2, 2])]
    grid = cells(runs)
    assert set(grid) == {("default", "mixed"), ("round_robin", "mixed")}
    d = grid[("default", "mixed")]
    assert len(d.timed) == 4
    assert d.stat("ttft", 50) == pytest.approx(0.02)
    assert d.stat("ttft", 95) == pytest.approx(0.04)
    assert d.per_rotation_p95() == [pytest.approx(0.02), pytest.approx(0.04)]
    assert d.hit_rate() == pytest.approx(0.5)
    assert d.imbalance() == pytest.approx((1.5 + 1.0) / 2)  # busiest / mean per run, averaged
    assert d.diag("same_as_previous") == pytest.approx(0.5)  # runs without the figure do not count
    assert d.throughput() == pytest.approx((1.0, 10.0))  # 4 done, 40 tokens over 4 s
    assert Cell([]).stat("ttft", 95) is None


def test_errors_are_counted_by_kind_and_left_out_of_latencies() -> None:
    timed = [_timed(0, 0.01, 0.1), _timed(1, 0.5, 0.6, error="timeout"), _timed(2, 0.5, 0.6, error="timeout"),
             _timed(3, 0.5, 0.6, error="http 503")]
    assert errors_text(timed) == "http 503: 1, timeout: 2"
    assert errors_text(timed[:1]) == "0"
    cell = Cell([Run("p", 0, "w", timed, 1.0, {}, 0.0, [4], 0, 0, 0)])
    assert cell.stat("ttft", 95) == pytest.approx(0.01)


def test_affinity_route_pins_each_group_to_one_backend() -> None:
    route = by_group(4)
    pinned = [route(Request(i, 0.0, "shared", (), 1, 1, group=g)) for i, g in enumerate([0, 1, 5, 4, 7])]
    assert pinned == [0, 1, 1, 0, 3]


def test_formatting() -> None:
    assert ms(None) == "-"
    assert ms(0.0123) == "12.3"
    assert ms(0.25) == "250"
    assert pct(None) == "-"
    assert pct(0.256) == "26%"


def test_run_py_keeps_the_pickled_names() -> None:
    # raw.pickle files from before the split name these classes as attributes of run.py (`__main__`).
    from benchmarks.routing import run
    from benchmarks.routing.crosscheck import Cross, Probe

    assert (run.Run, run.Cross, run.Probe) == (Run, Cross, Probe)
    saved = _run("default", 0, [0.01], [1])
    assert pickle.loads(pickle.dumps(saved)).timed[0].ttft == pytest.approx(0.01)
