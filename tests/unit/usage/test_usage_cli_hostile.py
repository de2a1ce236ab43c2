"""`modeldock usage` on corrupted or hostile files: every bad record is skipped and counted by reason,
never a traceback; names reach the terminal escaped; new fields (cost, cached tokens, rejections) add up."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from usage_helpers import BASE_TS, record

from modeldock.cli import main

REPO = Path(__file__).resolve().parents[3]
GOOD = record(request_id="good", prompt_tokens=10, completion_tokens=5).to_json()


def fields(**changes: Any) -> dict[str, Any]:
    return json.loads(GOOD) | changes


def line(**changes: Any) -> str:
    return json.dumps(fields(**changes))


def without_ts(time: object) -> str:
    data = fields(time=time)
    del data["ts"]
    return json.dumps(data)


def usage(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["usage", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("bad, reason, why", [
    (line(ts="soon"), "bad ts", "ts must be epoch seconds (a number from 0 to 253402300800), got 'soon'"),
    (line(ts="1700000000"), "bad ts", "ts must be epoch seconds (a number from 0 to 253402300800), got '1700000000'"),
    (line(ts=None), "bad ts", "ts must be epoch seconds (a number from 0 to 253402300800), got None"),
    (line(ts=[BASE_TS]), "bad ts", "ts must be epoch seconds (a number from 0 to 253402300800), got [1700000000.0]"),
    (line(ts={"s": 1}), "bad ts", "ts must be epoch seconds (a number from 0 to 253402300800), got {'s': 1}"),
    (line(ts=float("nan")), "bad ts", "ts must be epoch seconds (a number from 0 to 253402300800), got nan"),
    (line(ts=float("-inf")), "bad ts", "ts must be epoch seconds (a number from 0 to 253402300800), got -inf"),
    (GOOD.replace(f'"ts":{BASE_TS}', '"ts":1' + "0" * 400), "bad ts",
     "ts must be epoch seconds (a number from 0 to 253402300800), got 1" + "0" * 56 + "..."),
    (without_ts("next tuesday"), "bad time",
     "'next tuesday' is not an RFC 3339 time (e.g. 2025-01-31T12:00:00Z) or a date"),
    (without_ts(None), "bad time", "time must be an RFC 3339 string, got None"),
    (without_ts(["2023-11-14"]), "bad time", "time must be an RFC 3339 string, got ['2023-11-14']"),
    ("[" * 50_000 + "]" * 50_000, "not JSON", "not JSON: nested too deeply to parse"),
    ('{"a":' * 50_000 + "1" + "}" * 50_000, "not JSON", "not JSON: nested too deeply to parse"),
    (line(tenant={"id": "acme"}), "bad tenant", "tenant must be a string, got {'id': 'acme'}"),
    (line(cancelled="no"), "bad cancelled", "cancelled must be true or false, got 'no'"),
])
def test_a_malformed_record_is_skipped_with_its_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       bad: str, reason: str, why: str) -> None:
    path = tmp_path / "u.jsonl"
    path.write_text(GOOD + "\n" + bad + "\n" + GOOD + "\n")
    code, out, err = usage(capsys, str(path), "--json")
    assert code == 0
    document = json.loads(out)
    assert (document["total"]["requests"], document["total"]["prompt_tokens"]) == (2, 20)
    assert document["skipped"] == {"unreadable": 1, "unsupported": 0, "reasons": {reason: 1}}
    assert err == f"modeldock usage: skipped 1 record: 1 {reason}; first: {path.resolve()}:2: {why}\n"


def test_the_skip_count_names_each_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "u.jsonl"
    path.write_text("\n".join([GOOD, line(ts=None), "\x00\x01 not json", line(ts="x"), line(v=2), GOOD[:30]]) + "\n")
    code, out, err = usage(capsys, str(path))
    assert code == 0
    assert out.splitlines()[3].split()[:4] == ["acme", "1", "10", "5"]
    assert err.startswith("modeldock usage: skipped 5 records: 2 bad ts, 2 not JSON, 1 other version; first: ")


def test_a_nan_timestamp_is_in_no_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "u.jsonl"
    path.write_text(GOOD + "\n" + line(ts=float("nan"), prompt_tokens=1000) + "\n")
    for argv in (["--since", "2023-11-14"], ["--until", "2023-11-15"],
                 ["--since", "2023-11-14", "--until", "2023-11-15"], ["--since", "2030-01-01"]):
        code, out, _ = usage(capsys, str(path), "--json", *argv)
        assert code == 0
        total = json.loads(out)["total"]
        assert total["prompt_tokens"] == (0 if argv == ["--since", "2030-01-01"] else 10), argv


HOSTILE = "evil\x1b[2J\x1b]0;owned\x07\nfake-row\u2028\u202e\udc80\\x1b"
HOSTILE_PRINTED = r"evil\x1b[2J\x1b]0;owned\x07\x0afake-row\u2028\u202e\udc80\\x1b"


def hostile_file(tmp_path: Path) -> Path:
    path = tmp_path / "u.jsonl"
    path.write_text(line(tenant=HOSTILE, model="m\x1bx") + "\n" + GOOD + "\n")  # JSON escapes them on disk
    return path


def test_control_characters_in_names_are_escaped_in_the_table(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = usage(capsys, str(hostile_file(tmp_path)), "--by", "model")
    assert code == 0 and err == ""
    assert out.isascii() and out.isprintable() is False  # only the newlines between rows
    rows = out.splitlines()
    assert len(rows) == 7  # span, header, rule, 2 rows, rule, total: no name split a line
    assert rows[3].split()[:3] == ["acme", "llama-8b", "1"]
    assert rows[4].split()[:3] == [HOSTILE_PRINTED, r"m\x1bx", "1"]
    assert all(row.isprintable() for row in rows)


def test_control_characters_in_names_are_escaped_in_csv_and_kept_exact_in_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = hostile_file(tmp_path)
    code, out, _ = usage(capsys, str(path), "--csv")
    assert code == 0
    assert out.splitlines() == [
        "tenant,requests,prompt_tokens,completion_tokens,total_tokens,cached_tokens,cancelled,errors,rejected,"
        "estimated,cost",
        "acme,1,10,5,15,0,0,0,0,0,",
        HOSTILE_PRINTED + ",1,10,5,15,0,0,0,0,0,",
    ]
    code, out, _ = usage(capsys, str(path), "--json")
    assert code == 0 and out.isascii()
    assert [row["tenant"] for row in json.loads(out)["rows"]] == ["acme", HOSTILE]


def test_a_hostile_file_name_is_escaped_in_the_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = usage(capsys, str(tmp_path / "a\x1bc\x07b.jsonl"))
    assert code == 2
    assert err == f"modeldock usage: {tmp_path}/a\\x1bc\\x07b.jsonl: no such file\n"


def test_cost_cached_tokens_and_rejections_are_totalled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "u.jsonl"
    records = [
        record(prompt_tokens=1000, completion_tokens=200, cached_tokens=600, cost=0.0014),
        record(prompt_tokens=500, completion_tokens=0, status=400, cost=0.0005, termination="upstream_error"),
        record(prompt_tokens=0, completion_tokens=0, status=429, endpoint="", termination="rejected"),
        record(tenant="beta", prompt_tokens=3, completion_tokens=4),
    ]
    path.write_text("".join(r.to_json() + "\n" for r in records))
    code, out, _ = usage(capsys, str(path))
    assert code == 0
    rows = out.splitlines()
    assert rows[3].split() == ["acme", "3", "1500", "200", "1700", "600", "0", "1", "1", "0", "0.001900"]
    assert rows[4].split() == ["beta", "1", "3", "4", "7", "0", "0", "0", "0", "0"]  # no price: blank
    assert rows[6].split() == ["TOTAL", "4", "1503", "204", "1707", "600", "0", "1", "1", "0", "0.001900"]
    code, out, _ = usage(capsys, str(path), "--json")
    document = json.loads(out)
    assert [(r["tenant"], r["cost"], r["rejected"], r["errors"]) for r in document["rows"]] == [
        ("acme", pytest.approx(0.0019, abs=1e-12), 1, 1), ("beta", None, 0, 0)]
    code, out, _ = usage(capsys, str(path), "--csv")
    assert out.splitlines()[1:] == ["acme,3,1500,200,1700,600,0,1,1,0,0.001900", "beta,1,3,4,7,0,0,0,0,0,"]


def test_the_real_entry_point_prints_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "u.jsonl"
    path.write_text("\n".join([GOOD, line(ts="soon"), without_ts("never"), "[" * 100_000,
                               line(ts=float("nan")), line(tenant="x\x1b[2Jy")]) + "\n")
    done = subprocess.run([sys.executable, "-m", "modeldock.cli", "usage", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "\x1b" not in done.stdout
    assert done.stderr.startswith("modeldock usage: skipped 4 records: 2 bad ts, 1 bad time, 1 not JSON; first: ")
    assert [r.split()[:2] for r in done.stdout.splitlines()[3:5]] == [["acme", "1"], [r"x\x1b[2Jy", "1"]]


# -- never a crash, whatever the file holds --------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
_mangled = st.builds(lambda key, value: json.dumps(fields(**{key: value})),
                     st.sampled_from(sorted(json.loads(GOOD)) + ["cost", "cached_tokens", "termination",
                                                                 "response_bytes"]), _json)
_line = st.one_of(
    st.binary(max_size=200),
    _mangled.map(str.encode),
    st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.just(GOOD.encode()),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_line, max_size=12), separator=st.sampled_from([b"\n", b"\r\n", b"\r", b"\n\n"]),
       output=st.sampled_from([[], ["--json"], ["--csv"], ["--by", "model"]]))
def test_random_bytes_and_lines_never_crash_the_command(lines: list[bytes], separator: bytes,
                                                        output: list[str]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "u.jsonl"
        path.write_bytes(separator.join(lines))
        # Streams that encode strictly, as a UTF-8 terminal does: a lone surrogate would raise here.
        out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8") for _ in range(2))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["usage", str(path), *output])
            out.flush()
            err.flush()
        assert code == 0
        printed = out.buffer.getvalue().decode()  # type: ignore[attr-defined]
        if output != ["--json"]:
            assert "\x1b" not in printed and "\x07" not in printed and "\r" not in printed
        else:
            json.loads(printed)
        assert "Traceback" not in err.buffer.getvalue().decode()  # type: ignore[attr-defined]
