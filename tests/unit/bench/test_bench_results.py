from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from modeldock.bench.metrics import RequestRecord
from modeldock.bench.prompt import build_prompt
from modeldock.bench.report import PlotUnavailable, format_table, to_json, write_plot
from modeldock.bench.results import BenchOptions, BenchResult, TierParams, tier_result

OPTIONS = BenchOptions(url="http://x/v1", model="m", requests=6, concurrency=(4,), usage=True, token="s3cret")
PARAMS = TierParams.of(OPTIONS, 4, "2025-01-01T00:00:00.000+00:00")


def ok(index: int, ttft: float, e2e: float, tokens: int | None = 5) -> RequestRecord:
    return RequestRecord(
        index=index,
        sent_at=10.0,
        first_content_at=10.0 + ttft,
        last_content_at=10.0 + e2e - 0.01,
        ended_at=10.0 + e2e,
        completion_tokens=tokens,
    )


def failed(index: int, kind: str) -> RequestRecord:
    # Failed requests carry huge times: any leak into the statistics would show.
    record = RequestRecord(index=index, sent_at=0.0, first_content_at=500.0, last_content_at=900.0, ended_at=1000.0)
    record.fail(kind, f"{kind} detail")
    return record


def mixed_records() -> list[RequestRecord]:
    return [
        ok(0, 0.1, 1.0),
        ok(1, 0.2, 2.0),
        failed(2, "429"),
        ok(3, 0.3, 3.0),
        failed(4, "500"),
        failed(5, "429"),
        failed(6, "truncated"),
    ]


def test_errors_are_counted_by_kind_and_never_timed() -> None:
    tier = tier_result(PARAMS, mixed_records(), wall_time_s=2.0)
    assert tier.completed == 3
    assert tier.errors == {"429": 2, "500": 1, "truncated": 1}
    assert tier.error_total == 4
    assert tier.error_details["429"] == "429 detail"
    assert tier.ttft.count == 3 and tier.e2e.count == 3
    assert tier.ttft.max == pytest.approx(0.3)
    assert tier.e2e.max == pytest.approx(3.0)
    assert tier.e2e.mean == pytest.approx(2.0)
    assert tier.requests_per_s == pytest.approx(1.5)  # 3 completed / 2 s, errors excluded
    assert tier.output_tokens_per_s == pytest.approx(7.5)  # 15 usage tokens / 2 s


def test_output_tokens_per_s_needs_usage_on_every_completed_request() -> None:
    records = [ok(0, 0.1, 1.0, tokens=5), ok(1, 0.1, 1.0, tokens=None)]
    tier = tier_result(PARAMS, records, wall_time_s=1.0)
    assert tier.usage_reported == 1
    assert tier.output_tokens_per_s is None


def test_json_carries_parameters_next_to_numbers() -> None:
    tier = tier_result(PARAMS, mixed_records(), wall_time_s=2.0)
    data = json.loads(to_json(BenchResult(started_at="2025-01-01T00:00:00.000+00:00", tiers=[tier])))
    assert data["schema"] == "modeldock.bench/1"
    params = data["tiers"][0]["params"]
    for key in (
        "url",
        "model",
        "endpoint",
        "prompt_tokens",
        "max_tokens",
        "warmup",
        "concurrency",
        "requests",
        "usage",
        "started_at",
    ):
        assert key in params
    assert "s3cret" not in json.dumps(data)  # the bearer token is never reported
    assert params["concurrency"] == 4
    assert data["tiers"][0]["errors"] == {"429": 2, "500": 1, "truncated": 1}
    assert data["tiers"][0]["ttft_s"]["count"] == 3
    assert "samples" not in data["tiers"][0]
    with_samples = BenchResult(started_at="t", tiers=[tier]).to_dict(include_samples=True)
    assert sorted(with_samples["tiers"][0]["samples"]["ttft_s"]) == pytest.approx([0.1, 0.2, 0.3])


def test_table_shows_errors_and_units() -> None:
    tier = tier_result(PARAMS, mixed_records(), wall_time_s=2.0)
    table = format_table(BenchResult(started_at="t", tiers=[tier]))
    assert "concurrency 4" in table
    assert "errors 4 (429: 2, 500: 1, truncated: 1)" in table
    ttft_row = next(line for line in table.splitlines() if line.strip().startswith("TTFT"))
    assert ttft_row.split()[1:] == ["3", "200.0", "100.0", "200.0", "300.0", "300.0", "300.0"]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib is not installed (the `plot` extra)")
def test_plot_writes_a_png(tmp_path: Path) -> None:
    tier = tier_result(PARAMS, mixed_records(), wall_time_s=2.0)
    path = tmp_path / "bench.png"
    write_plot(BenchResult(started_at="t", tiers=[tier, tier]), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # makes the import fail
    with pytest.raises(PlotUnavailable, match="matplotlib"):
        write_plot(BenchResult(started_at="t", tiers=[]), tmp_path / "x.png")


def test_options_are_validated() -> None:
    with pytest.raises(ValueError):
        BenchOptions(url="u", model="m", concurrency=(1, 0))
    with pytest.raises(ValueError):
        BenchOptions(url="u", model="m", endpoint="embeddings")  # type: ignore[arg-type]
    assert "secret" not in repr(BenchOptions(url="u", model="m", token="secret"))


def test_prompts_are_deterministic_sized_and_distinct() -> None:
    assert build_prompt(50, 3) == build_prompt(50, 3)
    assert len(build_prompt(50, 3).split()) == 50
    assert build_prompt(50, 3) != build_prompt(50, 4)
    assert build_prompt(50, 3).split()[0] != build_prompt(50, 4).split()[0]
    assert build_prompt(50, 3, shared=True) == build_prompt(50, 4, shared=True)
    with pytest.raises(ValueError):
        build_prompt(0)
