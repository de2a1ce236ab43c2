"""`modeldock usage`: ranges, grouping, exact totals, tolerant reading, output formats."""

from __future__ import annotations

import csv
import io
import json
import random
from pathlib import Path

import pytest
from usage_helpers import BASE_TS, record

from modeldock.cli import main
from modeldock.usage import UsageRecord
from modeldock.usage.summary import ReadStats, expand, parse_when, read_records, summarize

HOUR = 3600.0


def corpus(seed: int = 7, count: int = 400) -> list[UsageRecord]:
    rng = random.Random(seed)
    return [
        record(request_id=f"r-{i}", ts=BASE_TS + rng.uniform(0, 48 * HOUR), tenant=rng.choice(["acme", "beta", "corp"]),
               model=rng.choice(["llama-8b", "mistral-7b"]), prompt_tokens=rng.randint(0, 5000),
               completion_tokens=rng.randint(0, 2000), status=rng.choice([200, 200, 200, 429, 500, 0]),
               cancelled=rng.random() < 0.1, token_source=rng.choice(["reported", "estimated"]))
        for i in range(count)
    ]


def write(path: Path, records: list[UsageRecord]) -> Path:
    path.write_text("".join(r.to_json() + "\n" for r in records))
    return path


def test_totals_are_exact_per_tenant_and_per_tenant_and_model() -> None:
    records = corpus()
    since, until = BASE_TS + 6 * HOUR, BASE_TS + 30 * HOUR
    inside = [r for r in records if since <= r.ts < until]
    assert 0 < len(inside) < len(records)
    for by_model in (False, True):
        summary = summarize(records, since, until, by_model=by_model)
        for (tenant, model), totals in summary.rows.items():
            mine = [r for r in inside if r.tenant == tenant and (not by_model or r.model == model)]
            assert totals.requests == len(mine)
            assert totals.prompt_tokens == sum(r.prompt_tokens for r in mine)
            assert totals.completion_tokens == sum(r.completion_tokens for r in mine)
            assert totals.cancelled == sum(r.cancelled for r in mine)
            assert totals.estimated == sum(r.token_source == "estimated" for r in mine)
        assert len(summary.rows) == (6 if by_model else 3)
        assert summary.total.requests == len(inside)
        assert summary.total.total_tokens == sum(r.prompt_tokens + r.completion_tokens for r in inside)


def test_totals_of_a_small_set_are_the_hand_counted_values() -> None:
    records = [
        record(status=200, prompt_tokens=100, completion_tokens=50, cached_tokens=40, cost=0.25),
        record(status=399, prompt_tokens=10, completion_tokens=0, cost=0.000001),
        record(status=400, prompt_tokens=7, completion_tokens=0),  # an error: the lowest error status
        record(status=500, prompt_tokens=3, completion_tokens=1, termination="upstream_error", cost=0.5),
        record(status=499, cancelled=True, prompt_tokens=20, completion_tokens=5, token_source="estimated",
               termination="client_disconnect"),
        record(status=429, prompt_tokens=0, completion_tokens=0, endpoint="", termination="rejected",
               token_source="estimated", served_model=""),  # as the director writes a refused request
        record(status=401, prompt_tokens=0, completion_tokens=0, endpoint="", termination="rejected"),
        record(tenant="beta", status=200, prompt_tokens=1, completion_tokens=2),
    ]
    summary = summarize(records)
    acme, beta = summary.rows[("acme", "")], summary.rows[("beta", "")]
    assert (acme.requests, acme.prompt_tokens, acme.completion_tokens, acme.total_tokens) == (7, 140, 56, 196)
    assert (acme.cached_tokens, acme.cancelled, acme.errors, acme.rejected, acme.estimated) == (40, 1, 2, 2, 1)
    assert acme.cost == pytest.approx(0.750001, abs=1e-12)
    assert (beta.requests, beta.errors, beta.rejected, beta.cost) == (1, 0, 0, None)  # no price: no cost
    assert (summary.total.requests, summary.total.errors, summary.total.total_tokens) == (8, 2, 199)


def test_range_includes_since_and_excludes_until() -> None:
    records = [record(ts=BASE_TS), record(ts=BASE_TS + 10), record(ts=BASE_TS + 20)]
    assert summarize(records, BASE_TS, BASE_TS + 20).total.requests == 2
    assert summarize(records, BASE_TS + 10, None).total.requests == 2
    assert summarize(records, None, BASE_TS + 10).total.requests == 1
    assert summarize(records, tenants=frozenset({"nobody"})).total.requests == 0


def test_relative_and_absolute_times() -> None:
    now = BASE_TS
    assert parse_when("24h", now) == now - 86400
    assert parse_when("30m", now) == now - 1800
    assert parse_when("1.5d", now) == now - 1.5 * 86400
    assert parse_when("2w", now) == now - 14 * 86400
    assert parse_when("now", now) == now
    assert parse_when("2023-11-14T22:13:20Z", 0) == BASE_TS
    with pytest.raises(ValueError, match="not an RFC 3339 time"):
        parse_when("24 hours", now)


def test_torn_and_foreign_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    good = [record(request_id=str(i)) for i in range(3)]
    path = tmp_path / "usage.a.jsonl"
    newer = json.dumps(json.loads(good[0].to_json()) | {"v": 2})
    path.write_text(good[0].to_json() + "\n\n" + good[1].to_json()[:30] + "\n" + newer + "\n"
                    + good[2].to_json() + "\n" + good[2].to_json()[:17])
    stats = ReadStats()
    assert [r.request_id for r in read_records([path], stats)] == ["0", "2"]
    assert (stats.records, stats.unreadable, stats.unsupported) == (2, 2, 1)
    assert stats.first_problem.startswith(f"{path}:3: not JSON")


def test_files_globs_and_directories_each_file_once(tmp_path: Path) -> None:
    a = write(tmp_path / "usage.gw-1.jsonl", [record()])
    b = write(tmp_path / "usage.gw-1.20231114T000000000000Z.jsonl", [record()])
    (tmp_path / "notes.txt").write_text("not usage")
    assert expand([str(tmp_path)]) == [b.resolve(), a.resolve()]
    assert expand([str(tmp_path / "usage.*"), str(a)]) == [b.resolve(), a.resolve()]
    with pytest.raises(FileNotFoundError, match="no usage files match"):
        expand([str(tmp_path / "nope.*")])
    with pytest.raises(FileNotFoundError, match="no such file"):
        expand([str(tmp_path / "missing.jsonl")])


def test_command_table_json_and_csv_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = corpus(count=120)
    half = len(records) // 2
    write(tmp_path / "usage.gw-1.jsonl", records[:half])
    write(tmp_path / "usage.gw-2.jsonl", records[half:])
    since, until = "2023-11-15T00:00:00Z", "2023-11-16T00:00:00+00:00"
    expected = summarize(records, parse_when(since, 0), parse_when(until, 0), by_model=True)

    assert main(["usage", str(tmp_path / "usage.*.jsonl"), "--since", since, "--until", until,
                 "--by", "model", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["since"] == "2023-11-15T00:00:00.000Z" and document["group_by"] == ["tenant", "model"]
    assert document["total"]["requests"] == expected.total.requests
    assert {(r["tenant"], r["model"]): r["prompt_tokens"] for r in document["rows"]} == {
        key: t.prompt_tokens for key, t in expected.rows.items()}

    assert main(["usage", str(tmp_path), "--since", since, "--until", until, "--by", "model", "--csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert {(r["tenant"], r["model"]): int(r["completion_tokens"]) for r in rows} == {
        key: t.completion_tokens for key, t in expected.rows.items()}

    assert main(["usage", str(tmp_path), "--since", since, "--until", until, "--tenant", "acme"]) == 0
    table = capsys.readouterr().out.splitlines()
    acme = summarize(records, parse_when(since, 0), parse_when(until, 0), tenants=frozenset({"acme"}))
    assert table[0] == "from 2023-11-15T00:00:00.000Z to 2023-11-16T00:00:00.000Z (UTC, end excluded)"
    assert table[1].split() == ["tenant", "requests", "prompt_tokens", "completion_tokens", "total_tokens",
                                "cached_tokens", "cancelled", "errors", "rejected", "estimated", "cost"]
    t = acme.total
    numbers = [str(v) for v in (t.requests, t.prompt_tokens, t.completion_tokens, t.total_tokens, t.cached_tokens,
                                t.cancelled, t.errors, t.rejected, t.estimated)]  # no price: cost blank
    assert table[3].split() == ["acme", *numbers] and table[-1].split() == ["TOTAL", *numbers]


@pytest.mark.parametrize("argv, message", [
    (["--since", "yesterday"], "'yesterday' is not an RFC 3339 time"),
    (["--since", "1h", "--until", "2h"], "--until must be after --since"),
])
def test_command_bad_input_exits_2_with_a_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 argv: list[str], message: str) -> None:
    write(tmp_path / "u.jsonl", [record()])
    assert main(["usage", str(tmp_path / "u.jsonl"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_command_missing_file_and_torn_line_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["usage", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl: no such file" in capsys.readouterr().err
    path = tmp_path / "u.jsonl"
    path.write_text(record().to_json() + "\n" + record().to_json()[:20])
    assert main(["usage", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["total"]["requests"] == 1 and json.loads(out)["skipped"]["unreadable"] == 1
    assert err.startswith(f"modeldock usage: skipped 1 record: 1 not JSON; first: {path.resolve()}:2: not JSON")
