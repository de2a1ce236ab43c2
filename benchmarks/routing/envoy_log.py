"""Where the gateway sent each request, from Envoy's access log (the format in envoy/bootstrap.yaml).

The client cannot see which backend served a request; Envoy's access log can. Each line gives the
request's start time (ms), the upstream, bytes in and out, the duration and the time to the
upstream's first response byte (`ttfb`, %RESPONSE_DURATION%), which is enough to tell
long generations from short answers (bytes out), long prompts from short ones (bytes in), and how
many requests each backend held at any moment.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

LINE = re.compile(r'^\[(?P<start>[^\]]+)\] "POST (?P<path>\S+)" (?P<code>\d+) \S+ attempts=\S+ '
                  r'upstream=(?P<up>\S+) rx=(?P<rx>\d+) tx=(?P<tx>\d+) dur=(?P<dur>\d+)ms(?: ttfb=(?P<ttfb>\d+)ms)?')


@dataclass(frozen=True)
class Entry:
    start: float  # unix seconds
    end: float
    upstream: str
    rx: int  # request bytes
    tx: int  # response bytes
    ttfb: float | None = None  # seconds from the request's first byte to the upstream's first response byte


def parse(path: Path) -> list[Entry]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if m is None or not m["path"].endswith("/chat/completions"):
            continue
        start = datetime.fromisoformat(m["start"].replace("Z", "+00:00")).timestamp()
        ttfb = int(m["ttfb"]) / 1000 if m["ttfb"] is not None else None
        out.append(Entry(start, start + int(m["dur"]) / 1000, m["up"], int(m["rx"]), int(m["tx"]), ttfb))
    return sorted(out, key=lambda e: e.start)


def within(entries: Iterable[Entry], begin: float, end: float) -> list[Entry]:
    return [e for e in entries if begin <= e.start <= end]


def over_slots(entries: Sequence[Entry], begin: float, end: float, slots: int, step: float = 0.005) -> float:
    """Fraction of [begin, end] during which some backend held more than `slots` requests (so at
    least one of them was queued, not running)."""
    ups = sorted({e.upstream for e in entries})
    if not ups or end <= begin:
        return 0.0
    events = []
    for e in entries:
        events.append((e.start, 1, e.upstream))
        events.append((e.end, -1, e.upstream))
    events.sort(key=lambda x: (x[0], x[1]))
    count: Counter[str] = Counter()
    over_time, t_prev, over = 0.0, begin, False
    for t, delta, up in events:
        lo, hi = max(t_prev, begin), min(t, end)
        if over and hi > lo:
            over_time += hi - lo
        t_prev = t
        count[up] += delta
        over = any(c > slots for c in count.values())
    if over and end > t_prev:
        over_time += end - max(t_prev, begin)
    return over_time / (end - begin)


def peak(entries: Sequence[Entry], pick: object = None) -> int:
    """Most requests (those `pick` selects, default all) one backend held at once."""
    chosen = [e for e in entries if pick is None or pick(e)]  # type: ignore[operator]
    events = sorted([(e.start, 1, e.upstream) for e in chosen] + [(e.end, -1, e.upstream) for e in chosen],
                    key=lambda x: (x[0], x[1]))
    count: Counter[str] = Counter()
    best = 0
    for _, delta, up in events:
        count[up] += delta
        best = max(best, count[up])
    return best


def bursts(entries: Sequence[Entry], min_rx: int, gap: float = 0.3) -> list[Counter[str]]:
    """Requests of at least `min_rx` bytes grouped into bursts (a new burst after `gap` seconds of
    none), each as a count per upstream."""
    groups: list[Counter[str]] = []
    last = None
    for e in entries:
        if e.rx < min_rx:
            continue
        if last is None or e.start - last > gap:
            groups.append(Counter())
        groups[-1][e.upstream] += 1
        last = e.start
    return groups


def burst_max_mean(entries: Sequence[Entry], min_rx: int) -> float | None:
    """Mean over bursts of the most burst requests one backend got (the ideal is size / backends)."""
    groups = bursts(entries, min_rx)
    return statistics.fmean(max(g.values()) for g in groups) if groups else None
