"""Read the series selectors and grouping labels out of a PromQL expression.

Enough of PromQL for dashboards: selectors with label matchers, functions, aggregations
(`sum by (x) (...)` and `sum(...) by (x)`), binary operators with on/ignoring/group_left,
ranges, subqueries, offsets, strings and numbers. Grafana variables (`$x`, `${x:regex}`,
`[[x]]`) outside strings are read as numbers, which is what they stand for there (a range,
a quantile); inside strings they stay as written. A name followed by `(` that is no PromQL function is an error,
so a misspelt function cannot pass for a metric.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

AGGREGATIONS = frozenset({
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
})
FUNCTIONS = frozenset({
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "avg_over_time",
    "ceil", "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh", "count_over_time", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "deg", "delta", "deriv", "exp", "floor",
    "histogram_avg", "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev",
    "histogram_stdvar", "histogram_sum", "hour", "idelta", "increase", "irate", "label_join", "label_replace",
    "last_over_time", "ln", "log10", "log2", "mad_over_time", "max_over_time", "min_over_time", "minute",
    "month", "pi", "predict_linear", "present_over_time", "quantile_over_time", "rad", "rate", "resets",
    "round", "scalar", "sgn", "sin", "sinh", "sort", "sort_by_label", "sort_by_label_desc", "sort_desc", "sqrt",
    "stddev_over_time", "stdvar_over_time", "sum_over_time", "tan", "tanh", "time", "timestamp", "vector",
    "year",
})
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
OPERATOR_WORDS = frozenset({"and", "or", "unless", "atan2", "bool", "offset"})
# Functions whose argument must be a counter (or a histogram's _bucket/_sum/_count).
COUNTER_FUNCTIONS = frozenset({"rate", "irate", "increase", "resets"})

_TOKEN = re.compile(
    r"""(?P<space>\s+|\#[^\n]*)
      | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
      | (?P<number>(?:\d|\.\d)[\w.]*|\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\])
      | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
      | (?P<op>=~|!~|==|!=|<=|>=|[-+*/%^<>=@,(){}\[\]:])""",
    re.VERBOSE,
)


class PromQLError(ValueError):
    pass


@dataclass(frozen=True)
class Selector:
    name: str
    labels: frozenset[str]  # label names in the matchers
    matchers: tuple[tuple[str, str, str], ...]  # (label, operator, value) as written
    functions: tuple[str, ...]  # enclosing functions and aggregations, outermost first


@dataclass
class Query:
    selectors: list[Selector] = field(default_factory=list)
    grouping: set[str] = field(default_factory=set)  # labels in by/without/on/ignoring/group_*


def tokens(expr: str) -> list[tuple[str, str]]:
    text = expr
    found: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise PromQLError(f"cannot read {text[pos:pos + 20]!r} in {expr!r}")
        kind = match.lastgroup or ""
        if kind != "space":
            found.append((kind, match.group()))
        pos = match.end()
    return found


def parse(expr: str) -> Query:
    toks = tokens(expr)
    query = Query()
    stack: list[str | None] = []  # one entry per open "(": the function it calls, or None
    pending: str | None = None  # an aggregation whose "(" comes after its by/without clause
    i = 0

    def peek(at: int) -> str:
        return toks[at][1] if at < len(toks) else ""

    while i < len(toks):
        kind, text = toks[i]
        if kind == "ident":
            if text in GROUPING:
                if peek(i + 1) == "(":
                    close = _closing(toks, i + 1, "(", ")")
                    query.grouping.update(t for k, t in toks[i + 2:close] if k == "ident")
                    i = close + 1
                    continue
                i += 1  # group_left without labels
                continue
            if text in OPERATOR_WORDS:
                i += 1
                continue
            if peek(i + 1) == "(":
                if text not in FUNCTIONS and text not in AGGREGATIONS:
                    raise PromQLError(f"{text!r} is no PromQL function, in {expr!r}")
                stack.append(text)
                i += 2
                continue
            if text in AGGREGATIONS and peek(i + 1) in ("by", "without"):
                pending = text
                i += 1
                continue
            i = _selector(toks, i, text, stack, query, expr)
            continue
        if text == "{":  # a selector with no name: {__name__="..."}
            i = _selector(toks, i, "", stack, query, expr)
            continue
        if text == "(":
            stack.append(pending)
            pending = None
        elif text == ")":
            if not stack:
                raise PromQLError(f"unbalanced ')' in {expr!r}")
            stack.pop()
        elif text == "[":
            i = _closing(toks, i, "[", "]")
        i += 1
    if stack:
        raise PromQLError(f"unbalanced '(' in {expr!r}")
    return query


def _closing(toks: list[tuple[str, str]], start: int, open_: str, close: str) -> int:
    for j in range(start + 1, len(toks)):
        if toks[j][1] == close:
            return j
        if toks[j][1] == open_:
            break
    raise PromQLError(f"no {close!r} for the {open_!r} at token {start}")


def _selector(toks: list[tuple[str, str]], i: int, name: str, stack: list[str | None], query: Query,
              expr: str) -> int:
    """Read `name{matchers}` from token i (the name, or the "{" of a nameless selector); return the next index."""
    j = i + 1 if name else i
    matchers: list[tuple[str, str, str]] = []
    if j < len(toks) and toks[j][1] == "{":
        close = _closing(toks, j, "{", "}")
        body = [t for t in toks[j + 1:close] if t[1] != ","]
        if len(body) % 3:
            raise PromQLError(f"cannot read the matchers of {name or '{...}'} in {expr!r}")
        for k in range(0, len(body), 3):
            (lk, label), (_, op), (vk, value) = body[k:k + 3]
            if lk != "ident" or vk != "string" or op not in ("=", "!=", "=~", "!~"):
                raise PromQLError(f"bad matcher {label}{op}{value} in {expr!r}")
            matchers.append((label, op, value[1:-1]))
        j = close + 1
    if not name:
        names = [v for label, op, v in matchers if label == "__name__" and op == "="]
        if len(names) != 1:
            raise PromQLError(f"a selector without a metric name in {expr!r}")
        name = names[0]
    query.selectors.append(Selector(
        name=name,
        labels=frozenset(label for label, _, _ in matchers if label != "__name__"),
        matchers=tuple(m for m in matchers if m[0] != "__name__"),
        functions=tuple(f for f in stack if f is not None),
    ))
    return j


_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<selector>.+),\s*(?P<label>[A-Za-z_]\w*)\s*\)\s*$")


def label_values(query: str) -> tuple[Selector, str]:
    """The selector and label of a Grafana `label_values(selector, label)` variable query."""
    match = _LABEL_VALUES.match(query)
    if match is None:
        raise PromQLError(f"not a label_values(selector, label) query: {query!r}")
    selectors = parse(match["selector"]).selectors
    if len(selectors) != 1:
        raise PromQLError(f"label_values needs one selector: {query!r}")
    return selectors[0], match["label"]
