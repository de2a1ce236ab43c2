"""`modeldock bench`: argument parsing and output; the work is in runner.py."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time
from typing import TextIO

from modeldock.bench.report import PlotUnavailable, format_table, require_matplotlib, to_json, write_plot
from modeldock.bench.results import BenchOptions
from modeldock.bench.runner import Progress, run_benchmark
from modeldock.bench.target import DEFAULT_URL, first_model, resolve_url

TOKEN_ENV = "GATEWAY_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help=f"the OpenAI-compatible API: a base URL ({DEFAULT_URL}) or a full endpoint URL "
        f"(.../v1/chat/completions, .../v1/completions) (default {DEFAULT_URL})",
    )
    parser.add_argument(
        "--model", help="model name sent in every request (default: the first model GET /v1/models lists)"
    )
    parser.add_argument("--requests", type=_positive_int, default=100, help="measured requests per tier (default 100)")
    parser.add_argument(
        "--concurrency",
        type=parse_tiers,
        default=(1,),
        help="requests in flight: one value or a comma list of tiers run in order, e.g. 1,16,64 (default 1)",
    )
    parser.add_argument(
        "--warmup", type=_non_negative_int, default=0, help="unmeasured requests before each tier (default 0)"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=_positive_int,
        default=128,
        help="approximate prompt length; 1 word ≈ 1 token (default 128)",
    )
    parser.add_argument("--max-tokens", type=_positive_int, default=128, help="output cap per request (default 128)")
    parser.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        help="API to call (default chat, or the one a full endpoint URL names)",
    )
    parser.add_argument(
        "--usage", action="store_true", help="send stream_options.include_usage; needed for TPOT and output tok/s"
    )
    parser.add_argument(
        "--timeout", type=_positive_float, default=60.0, help="per-request seconds, send to end of stream (default 60)"
    )
    parser.add_argument(
        "--shared-prompt", action="store_true", help="send the same prompt every time (lets prefix caches help)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout, and nothing else")
    parser.add_argument("--samples", action="store_true", help="with --json, include every request's TTFT/TPOT/E2E")
    parser.add_argument(
        "--plot", metavar="PATH", help="write a PNG of TTFT distributions and percentiles (needs matplotlib)"
    )
    parser.add_argument(
        "--progress", action="store_true", help="show progress on stderr even when it is not a terminal"
    )
    if parser.epilog is None:  # keep whatever the caller already set
        parser.epilog = f"The bearer token is read from ${TOKEN_ENV} (no Authorization header if unset)."


def run(args: argparse.Namespace) -> int:
    """Exit 0 when at least one request completed, 1 when none did or the plot failed, 2 on bad options."""
    try:
        options = options_from_args(args)
        if not options.model:
            model, count = asyncio.run(first_model(options.url, options.token, min(options.timeout, 10.0)))
            options = dataclasses.replace(options, model=model)
            print(f"modeldock bench: no --model given; using {model!r}, the first of {count} model(s) "
                  f"listed at {options.url.rstrip('/')}/models", file=sys.stderr)
    except ValueError as exc:
        print(f"modeldock bench: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            require_matplotlib()  # fail before a long run, not after it
        except PlotUnavailable as exc:
            print(f"modeldock bench: {exc}", file=sys.stderr)
            return 1
    progress = ProgressLine(sys.stderr) if args.progress or sys.stderr.isatty() else None
    try:
        result = asyncio.run(run_benchmark(options, progress))
    except KeyboardInterrupt:
        print("\nmodeldock bench: interrupted", file=sys.stderr)
        return 130
    if args.json:
        sys.stdout.write(to_json(result, include_samples=args.samples) + "\n")
    else:
        sys.stdout.write(format_table(result))
    sys.stdout.flush()
    if args.plot:
        write_plot(result, args.plot)
        print(f"modeldock bench: plot written to {args.plot}", file=sys.stderr)
    return 0 if any(t.completed for t in result.tiers) else 1


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """Options from the flags; `model` is empty when --model was not given (see `run`)."""
    url, endpoint = resolve_url(args.url, args.endpoint)
    return BenchOptions(
        url=url,
        model=args.model or "",
        requests=args.requests,
        concurrency=tuple(args.concurrency),
        warmup=args.warmup,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        endpoint=endpoint,
        usage=args.usage,
        timeout=args.timeout,
        token=os.environ.get(TOKEN_ENV) or None,
        shared_prompt=args.shared_prompt,
    )


def parse_tiers(text: str) -> tuple[int, ...]:
    """'1,16,64' -> (1, 16, 64); every tier a positive integer."""
    try:
        tiers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if any(t < 1 for t in tiers):
        raise argparse.ArgumentTypeError(f"every concurrency tier must be at least 1, got {text!r}")
    return tiers


class ProgressLine:
    """A one-line progress bar redrawn with \\r, at most ten times a second."""

    def __init__(self, stream: TextIO, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self._last_draw = 0.0

    def __call__(self, progress: Progress) -> None:
        finished = progress.done >= progress.total
        now = time.monotonic()
        if not finished and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        filled = self.width * progress.done // max(progress.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(
            f"\rconcurrency {progress.concurrency} {progress.phase:<7} [{bar}] "
            f"{progress.done}/{progress.total} errors {progress.errors}"
        )
        if finished:
            self.stream.write("\n")
        self.stream.flush()


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="modeldock bench", description="Load-test an OpenAI-compatible streaming endpoint."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
