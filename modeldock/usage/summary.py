r"""Read usage files and add them up per tenant (and model) over a time range.

Reading is tolerant: blank lines are skipped; a line that is not a whole, well-typed record
(a torn last line after a crash, foreign text, a corrupted or hostile field) and a record of
another format version are skipped and counted by reason, so one bad line never hides the
rest of a file and never stops the command.

Output is safe to print: in the table and CSV, control, format and separator characters
(ESC, BEL, newline, U+2028, U+202E, lone surrogates) and the backslash in a tenant or
model name are written as Python-style escapes (`\x1b`, `\u2028`, `\\`).
"""

from __future__ import annotations

import csv
import glob
import io
import json
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from modeldock.usage.record import RecordError, UnsupportedVersion, UsageRecord, parse_time, rfc3339

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_when(text: str, now: float) -> float:
    """`24h`, `30m`, `7d`, `90s`, `2w` (that long before `now`), `now`, or an RFC 3339 time / date."""
    value = text.strip()
    if value == "now":
        return now
    match = _RELATIVE.match(value)
    if match:
        return now - float(match.group(1)) * _UNIT[match.group(2)]
    return parse_time(value)


def expand(patterns: Iterable[str]) -> list[Path]:
    """Files named by paths, globs or directories (every *.jsonl in it), each once, in name order."""
    found: dict[Path, None] = {}
    for pattern in patterns:
        path = Path(pattern)
        if path.is_dir():
            matches = sorted(str(p) for p in path.glob("*.jsonl"))
        elif glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern))
        else:
            matches = [pattern]
        if not matches:
            raise FileNotFoundError(f"{pattern}: no usage files match")
        for match in matches:
            file = Path(match)
            if not file.is_file():
                raise FileNotFoundError(f"{match}: no such file")
            found.setdefault(file.resolve(), None)
    return list(found)


@dataclass
class ReadStats:
    files: int = 0
    records: int = 0
    unreadable: int = 0  # not a record: a torn line after a crash, foreign text, a field of the wrong type
    unsupported: int = 0  # another format version
    first_problem: str = ""
    reasons: Counter[str] = field(default_factory=Counter)  # skipped lines by RecordError.reason

    @property
    def skipped(self) -> int:
        return self.unreadable + self.unsupported

    def _problem(self, where: str, why: str) -> None:
        if not self.first_problem:
            self.first_problem = f"{where}: {why}"

    def describe(self) -> str:
        """`skipped 3 records: 2 bad ts, 1 not JSON; first: usage.jsonl:4: ...` (safe to print)."""
        counts = ", ".join(f"{n} {reason}" for reason, n in sorted(self.reasons.items(), key=lambda i: (-i[1], i[0])))
        noun = "record" if self.skipped == 1 else "records"
        return printable(f"skipped {self.skipped} {noun}: {counts}; first: {self.first_problem}")


def read_records(paths: Iterable[Path], stats: ReadStats | None = None) -> Iterator[UsageRecord]:
    stats = stats if stats is not None else ReadStats()
    for path in paths:
        stats.files += 1
        with open(path, encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = UsageRecord.from_json(line)
                except RecordError as exc:
                    if isinstance(exc, UnsupportedVersion):
                        stats.unsupported += 1
                    else:
                        stats.unreadable += 1
                    stats.reasons[exc.reason] += 1
                    stats._problem(f"{path}:{number}", str(exc))
                    continue
                stats.records += 1
                yield record


@dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, served from the prefix cache
    cancelled: int = 0
    errors: int = 0  # status >= 400, not cancelled, not rejected (UsageRecord.is_error)
    rejected: int = 0  # refused by the gateway itself (termination "rejected")
    estimated: int = 0  # requests whose tokens the gateway estimated (rejected ones used none)
    cost: float | None = None  # sum of the records' costs; None when none of them had a price

    def add(self, record: UsageRecord) -> None:
        self.requests += 1
        self.prompt_tokens += record.prompt_tokens
        self.completion_tokens += record.completion_tokens
        self.cached_tokens += record.cached_tokens
        self.cancelled += record.cancelled
        self.errors += record.is_error
        self.rejected += record.is_rejected
        self.estimated += record.token_source == "estimated" and not record.is_rejected  # 0 tokens: none to estimate
        if record.cost is not None:
            self.cost = (self.cost or 0.0) + record.cost

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class UsageSummary:
    since: float | None
    until: float | None
    by_model: bool
    rows: dict[tuple[str, str], Totals] = field(default_factory=dict)
    total: Totals = field(default_factory=Totals)

    def sorted_rows(self) -> list[tuple[tuple[str, str], Totals]]:
        return sorted(self.rows.items())


def summarize(records: Iterable[UsageRecord], since: float | None = None, until: float | None = None,
              by_model: bool = False, tenants: frozenset[str] | None = None) -> UsageSummary:
    """Totals of the records with since <= ts < until (either bound may be None), per tenant or (tenant, model)."""
    summary = UsageSummary(since, until, by_model)
    for record in records:
        if (since is not None and record.ts < since) or (until is not None and record.ts >= until):
            continue
        if tenants is not None and record.tenant not in tenants:
            continue
        key = (record.tenant, record.model if by_model else "")
        totals = summary.rows.get(key)
        if totals is None:
            totals = summary.rows[key] = Totals()
        totals.add(record)
        summary.total.add(record)
    return summary


COLUMNS = ("requests", "prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens", "cancelled",
           "errors", "rejected", "estimated", "cost")
# Unicode categories escaped on output: controls, format characters (e.g. U+202E, which reverses the text
# after it), surrogates, unassigned and private-use code points, line and paragraph separators.
_UNPRINTABLE = frozenset(("Cc", "Cf", "Cs", "Cn", "Co", "Zl", "Zp"))


def printable(text: str) -> str:
    r"""`text` with every character a terminal could act on, and the backslash, escaped (`\x1b`, `\u2028`, `\\`)."""
    if text.isprintable() and "\\" not in text:
        return text  # the usual name: no copy
    out = []
    for char in text:
        if char == "\\":
            out.append("\\\\")
        elif unicodedata.category(char) in _UNPRINTABLE:
            code = ord(char)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
        else:
            out.append(char)
    return "".join(out)


def format_cost(cost: float | None) -> str:
    """Six decimals (millionths of the currency); blank when no record had a price."""
    return "" if cost is None else f"{cost:.6f}"


def _values(totals: Totals) -> list[str]:
    return [format_cost(totals.cost) if name == "cost" else str(getattr(totals, name)) for name in COLUMNS]


def _keys(summary: UsageSummary) -> list[str]:
    return ["tenant", "model"] if summary.by_model else ["tenant"]


def _key_values(summary: UsageSummary, key: tuple[str, str], safe: bool = True) -> list[str]:
    """The row's tenant (and model); escaped for the terminal unless `safe` is False (JSON escapes itself)."""
    names = [key[0], key[1]] if summary.by_model else [key[0]]
    return [printable(n) for n in names] if safe else names


def format_table(summary: UsageSummary) -> str:
    header = _keys(summary) + list(COLUMNS)
    body = [_key_values(summary, key) + _values(t) for key, t in summary.sorted_rows()]
    total = ["TOTAL"] + ([""] if summary.by_model else []) + _values(summary.total)
    widths = [max(len(row[i]) for row in [header, *body, total]) for i in range(len(header))]
    keys = len(_keys(summary))

    def line(cells: list[str]) -> str:
        padded = (c.ljust(w) if i < keys else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        return "  ".join(padded).rstrip()

    rule = "  ".join("-" * w for w in widths)
    span = f"from {_when(summary.since, '(start)')} to {_when(summary.until, '(end)')} (UTC, end excluded)"
    return "\n".join([span, line(header), rule, *(line(r) for r in body), rule, line(total)]) + "\n"


def _when(epoch: float | None, unbounded: str) -> str:
    return unbounded if epoch is None else rfc3339(epoch)


def format_json(summary: UsageSummary, stats: ReadStats | None = None) -> str:
    def row(key: tuple[str, str], totals: Totals) -> dict[str, object]:
        out: dict[str, object] = dict(zip(_keys(summary), _key_values(summary, key, safe=False), strict=True))
        out.update(asdict(totals), total_tokens=totals.total_tokens)
        return out

    document: dict[str, object] = {
        "since": None if summary.since is None else rfc3339(summary.since),
        "until": None if summary.until is None else rfc3339(summary.until),
        "group_by": _keys(summary),
        "rows": [row(key, totals) for key, totals in summary.sorted_rows()],
        "total": asdict(summary.total) | {"total_tokens": summary.total.total_tokens},
    }
    if stats is not None:
        document["skipped"] = {"unreadable": stats.unreadable, "unsupported": stats.unsupported,
                               "reasons": dict(sorted(stats.reasons.items()))}
    return json.dumps(document, indent=2) + "\n"


def format_csv(summary: UsageSummary) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(_keys(summary) + list(COLUMNS))
    for key, totals in summary.sorted_rows():
        writer.writerow(_key_values(summary, key) + _values(totals))
    return out.getvalue()
