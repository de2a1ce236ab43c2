"""Read the few load series picking needs out of a vLLM /metrics page.

A real page is ~35-100 KB, almost all histogram buckets. One regex with a
literal prefix (`\\nvllm`) lets the C matcher skip everything else, so only
the handful of matching lines reach Python.

It also stops early. The text format keeps every family's lines in one group, its
HELP and TYPE lines first, and vLLM registers its gauges and token counters
before its histograms, so once every family wanted has been seen (in the `vllm:`
spelling, which a full scan would prefer anyway) only the group open at that
point can hold more of them: the scan reads on to the next family's comment line
and stops there. A page that lacks one of them, or spells them `vllm_`, is read
whole. `whole=True` always reads the whole page (the reference the tests compare
against, and the benchmark's before).
"""

from __future__ import annotations

import math
import re

from modeldock.picking.signals import Sample

_LOAD = (r"num_requests_waiting|num_requests_running|kv_cache_usage_perc|gpu_cache_usage_perc"
         r"|prompt_tokens_total|generation_tokens_total")
# name, optional {labels}, value; the label group runs to the last `}` on the line.
_TAIL = r"(?:\{([^\n]*)\})?[ \t]+([^ \t\n]+)"
# Two pattern pairs: cache_config_info (KV capacity) never changes while a server runs, so the
# scraper asks for it only now and then, and the usual scrape does not match it at all.
_LINE = re.compile(r"\nvllm([:_])(" + _LOAD + ")" + _TAIL)
_FIRST = re.compile(r"vllm([:_])(" + _LOAD + ")" + _TAIL)  # the page's first line has no leading newline
_LINE_CAP = re.compile(r"\nvllm([:_])(" + _LOAD + "|cache_config_info)" + _TAIL)
_FIRST_CAP = re.compile(r"vllm([:_])(" + _LOAD + "|cache_config_info)" + _TAIL)
_BLOCKS = re.compile(r'(?:^|[ ,])num_gpu_blocks="(\d+)"')
_BLOCK_SIZE = re.compile(r'(?:^|[ ,])block_size="(\d+)"')
_ENGINE = re.compile(r'(?:^|[ ,])engine="([^"]*)"')
# The families whose `vllm:` groups, once all seen, make the rest of the page irrelevant
# (`gpu_cache_usage_perc` is not among them: `kv_cache_usage_perc` wins over it).
_NEEDED = frozenset({"num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "prompt_tokens_total",
                     "generation_tokens_total"})
_NEEDED_CAP = _NEEDED | {"cache_config_info"}

_Line = tuple[str, str, str, str]  # spelling (":" or "_"), family, labels, raw value


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _names_other_model(labels: str, wanted: str) -> bool:
    """True when `labels` has a model_name label whose (escaped) value is not `wanted`."""
    at = labels.find('model_name="')
    while at > 0 and labels[at - 1] not in ", ":  # e.g. served_model_name: keep looking
        at = labels.find('model_name="', at + 1)
    if at == -1:
        return False
    # Escaped values cannot hold a bare quote, so a prefix match plus the closing quote is exact.
    return not labels.startswith(wanted + '"', at + 12)


def _capacity(labels: str) -> tuple[str, int, int] | None:
    """(engine, num_gpu_blocks x block_size, block_size) from one cache_config_info series; None
    before vLLM has profiled its cache (`num_gpu_blocks="None"`) or when a label is missing."""
    blocks, size = _BLOCKS.search(labels), _BLOCK_SIZE.search(labels)
    if blocks is None or size is None:
        return None
    engine = _ENGINE.search(labels)
    return (engine.group(1) if engine else ""), int(blocks.group(1)) * int(size.group(1)), int(size.group(1))


def _lines(text: str, capacity: bool, whole: bool) -> list[_Line]:
    """The matching lines, in page order: all of them, or up to the end of the group open when the
    last needed family was first seen (see the module doc)."""
    line = _LINE_CAP if capacity else _LINE
    first = (_FIRST_CAP if capacity else _FIRST).match(text)
    found: list[_Line] = [] if first is None else [(first[1], first[2], first[3] or "", first[4])]
    if whole:
        return found + line.findall(text)
    missing = set(_NEEDED_CAP if capacity else _NEEDED)
    if first is not None and first[1] == ":":
        missing.discard(first[2])
    for match in line.finditer(text):
        found.append((match[1], match[2], match[3] or "", match[4]))
        if match[1] == ":" and missing:
            missing.discard(match[2])
            if not missing:
                end = text.find("\n# ", match.end())  # the next family's HELP or TYPE line
                return found + line.findall(text, match.end(), len(text) if end == -1 else end)
    return found


def parse_metrics(text: str, model: str | None, *, capacity: bool = False, whole: bool = False) -> Sample | None:
    """The served model's load, summed over engines; None if the page has none.

    Series whose `model_name` label differs from `model` are ignored; series
    without the label are taken. `model=None` takes every series. Counts are
    summed over the `engine` label; KV usage (a 0..1 fraction per engine) is
    averaged and clamped to [0, 1], since a sum of fractions means nothing.
    Prefers the `vllm:` spelling and `kv_cache_usage_perc` over the older
    `gpu_cache_usage_perc` when a page carries both. The token counters
    (prompt + generation, summed) become `tokens_total`, the generation counter alone
    `generated_total`; with `capacity`, the
    KV capacity in tokens from `cache_config_info` (summed over engines), and its block size.
    Stops early where the page allows (module doc); `whole` reads every line.
    """
    totals: dict[tuple[str, str], float] = {}
    counts: dict[tuple[str, str], int] = {}
    wanted = _escape(model) if model is not None else None
    engines: dict[str, int] = {}
    block = 0
    for sep, name, labels, raw in _lines(text, capacity, whole):
        if name == "cache_config_info":
            found = _capacity(labels)
            if found is not None:
                engines[found[0]] = found[1]
                block = max(block, found[2])
            continue
        if wanted is not None and "model_name" in labels and _names_other_model(labels, wanted):
            continue
        try:
            value = float(raw)
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        key = (sep, name)
        totals[key] = totals.get(key, 0.0) + value
        counts[key] = counts.get(key, 0) + 1
    sep = ":" if any(k[0] == ":" for k in totals) else "_"
    waiting = totals.get((sep, "num_requests_waiting"))
    running = totals.get((sep, "num_requests_running"))
    if waiting is None and running is None:
        return None
    kv_key = (sep, "kv_cache_usage_perc")
    if kv_key not in totals:
        kv_key = (sep, "gpu_cache_usage_perc")
    kv = totals[kv_key] / counts[kv_key] if kv_key in totals else 0.0
    prompt, generated = totals.get((sep, "prompt_tokens_total")), totals.get((sep, "generation_tokens_total"))
    tokens = None if prompt is None and generated is None else (prompt or 0.0) + (generated or 0.0)
    return Sample(
        waiting=max(0.0, waiting or 0.0),
        running=max(0.0, running or 0.0),
        kv=min(1.0, max(0.0, kv)),
        capacity=float(sum(engines.values())) if engines else None,
        block_size=block or None,
        tokens_total=tokens,
        generated_total=generated,
    )
