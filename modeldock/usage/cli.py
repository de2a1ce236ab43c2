"""`modeldock usage`: per-tenant totals from usage record files."""

from __future__ import annotations

import argparse
import sys
import time

from modeldock.usage.summary import (
    ReadStats,
    expand,
    format_csv,
    format_json,
    format_table,
    parse_when,
    read_records,
    summarize,
)

DESCRIPTION = """\
Add up usage records (JSON lines written by ext_proc, see modeldock/usage/README.md) per tenant,
or per tenant and model, over a time range: requests, prompt and completion tokens, cancelled
requests, errors (status >= 400, not cancelled), and requests whose tokens were estimated.

The range is [--since, --until): a record counts by the time its request ended."""

EPILOG = """\
examples:
  modeldock usage /var/lib/modeldock/usage.*.jsonl --since 24h
  modeldock usage /var/lib/modeldock/ --since 2025-01-01 --until 2025-02-01 --by model --csv
  modeldock usage a.jsonl b.jsonl --tenant acme --json

A torn last line (a crash mid-write) or a record of another format version is skipped and
reported on stderr; the other records still count."""


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
        print(f"modeldock usage: {exc}", file=sys.stderr)
        return 2
    if since is not None and until is not None and until <= since:
        print("modeldock usage: --until must be after --since", file=sys.stderr)
        return 2
    try:
        paths = expand(args.files)
        stats = ReadStats()
        summary = summarize(read_records(paths, stats), since, until, by_model=args.by == "model",
                            tenants=frozenset(args.tenant) if args.tenant else None)
    except OSError as exc:
        print(f"modeldock usage: {exc}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(format_json(summary, stats))
    elif args.csv:
        sys.stdout.write(format_csv(summary))
    else:
        sys.stdout.write(format_table(summary))
    skipped = stats.unreadable + stats.unsupported
    if skipped:
        print(f"modeldock usage: skipped {stats.unreadable} unreadable line(s) (torn or not a record) and "
              f"{stats.unsupported} record(s) of another format version; first: {stats.first_problem}",
              file=sys.stderr)
    return 0
