"""`modeldock usage`: per-tenant totals from usage record files."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

from modeldock.usage.summary import (
    ReadStats,
    expand,
    format_csv,
    format_json,
    format_table,
    parse_when,
    printable,
    read_records,
    summarize,
)

DESCRIPTION = """\
Add up usage records (JSON lines written by ext_proc, see modeldock/usage/README.md) per tenant,
or per tenant and model, over a time range: requests, prompt, completion and cached tokens,
cancelled requests, errors (status >= 400, not cancelled, not rejected), requests the gateway
rejected itself, requests whose tokens were estimated, and cost (in the price's currency).

The range is [--since, --until): a record counts by the time its request ended."""

EPILOG = """\
examples:
  modeldock usage /var/lib/modeldock/usage.*.jsonl --since 24h
  modeldock usage /var/lib/modeldock/ --since 2025-01-01 --until 2025-02-01 --by model --csv
  modeldock usage a.jsonl b.jsonl --tenant acme --json

A torn last line (a crash mid-write), a malformed record or a record of another format version
is skipped and counted by reason on stderr; the other records still count. Tenant and model
names are printed with control characters escaped (\\x1b)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="usage files, globs (quote them) or directories (every *.jsonl in it); "
                             "include rotated files, e.g. 'usage.*.jsonl'")
    parser.add_argument("--since", metavar="WHEN",
                        help="first moment counted: RFC 3339 (2025-01-31T00:00:00Z; no offset = UTC), "
                             "a date (2025-01-31), or a time ago: 90s, 30m, 24h, 7d, 2w (default: all)")
    parser.add_argument("--until", metavar="WHEN", help="end of the range, not included; same forms (default: no end)")
    parser.add_argument("--by", choices=("tenant", "model"), default="tenant",
                        help="one row per tenant (default), or per tenant and model")
    parser.add_argument("--tenant", action="append", metavar="ID", help="only this tenant (repeatable)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON (rows, total, skipped lines)")
    output.add_argument("--csv", action="store_true", help="print CSV (a header, then one line per row)")


def run(args: argparse.Namespace) -> int:
    now = time.time()
    try:
        since = parse_when(args.since, now) if args.since else None
        until = parse_when(args.until, now) if args.until else None
    except ValueError as exc:
        _fail(str(exc))
        return 2
    if since is not None and until is not None and until <= since:
        _fail("--until must be after --since")
        return 2
    try:
        paths = expand(args.files)
        stats = ReadStats()
        summary = summarize(read_records(paths, stats), since, until, by_model=args.by == "model",
                            tenants=frozenset(args.tenant) if args.tenant else None)
    except OSError as exc:
        _fail(str(exc))
        return 2
    if args.json:
        _write(sys.stdout, format_json(summary, stats))
    elif args.csv:
        _write(sys.stdout, format_csv(summary))
    else:
        _write(sys.stdout, format_table(summary))
    if stats.skipped:
        _write(sys.stderr, f"modeldock usage: {stats.describe()}\n")
    return 0


def _fail(reason: str) -> None:
    _write(sys.stderr, f"modeldock usage: {printable(reason)}\n")  # a file name can hold an ESC too


def _write(stream: TextIO, text: str) -> None:
    """Write `text`; what the stream's encoding cannot hold (a non-UTF-8 terminal) becomes an escape."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
