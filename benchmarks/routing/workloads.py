"""Seeded request sequences for the routing benchmark.

A workload is a list of `Request`s, each with an arrival offset in **simulated seconds** (GPU time
of the modelled H100; the runner divides by the simulator's `--speed` to get wall time), its chat
messages and its `max_tokens`. Everything is a pure function of its arguments and `seed`: the same
call gives the same requests, byte for byte, so every policy sees exactly the same work.

Lengths are counted as the simulator counts tokens: 4 characters each
(`modeldock.sim.tokens.CHARS_PER_TOKEN`). A prompt of N tokens is a text of exactly 4N characters
made of short English words, so it also reads as a plausible prompt for a real server (where a BPE
tokenizer would count roughly one token per word, i.e. somewhat fewer tokens).

Arrivals are open-loop: Poisson processes (exponential gaps) plus, for `bursts`, groups of requests
that land within a few milliseconds of each other. An open loop keeps sending at the planned rate
whatever the latency, so a backend that routing overloads builds a queue, and the queue shows up in
TTFT. (A closed loop would slow its own sending down and hide the queue.)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modeldock.bench.prompt import WORDS

CHARS_PER_TOKEN = 4  # as modeldock.sim.tokens; repeated so this module needs no simulator import


@dataclass(frozen=True)
class Request:
    index: int
    at: float  # arrival offset from the workload's start, simulated seconds
    kind: str  # short | long (mixed); background | burst (bursts); shared (shared)
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    prompt_tokens: int  # content tokens as the simulator counts them (the chat template adds ~3 per message)
    group: int | None = None  # the burst number, or the shared-prefix group
    measured: bool = True  # False for warm-up arrivals: sent, so the backends reach a steady state, not counted

    def body(self, model: str) -> dict[str, Any]:
        """The streaming chat request, with usage so output tokens are counted exactly."""
        return {
            "model": model,
            "messages": [dict(m) for m in self.messages],
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    duration: float  # simulated seconds of measured arrivals
    requests: tuple[Request, ...]
    params: dict[str, Any] = field(default_factory=dict)
    warmup: float = 0.0  # simulated seconds of unmeasured arrivals before them

    @property
    def measured(self) -> tuple[Request, ...]:
        return tuple(r for r in self.requests if r.measured)

    def kinds(self) -> list[str]:
        return sorted({r.kind for r in self.requests})


def text(tokens: int, rng: random.Random, head: str = "") -> str:
    """Exactly `tokens` * 4 characters: `head`, then random words, cut to length."""
    if tokens < 1:
        raise ValueError("a text needs at least one token")
    size = tokens * CHARS_PER_TOKEN
    parts = [head] if head else []
    length = len(head)
    while length < size:
        word = rng.choice(WORDS)
        parts.append(word)
        length += len(word) + (1 if len(parts) > 1 else 0)
    return " ".join(parts)[:size]


def poisson_times(rng: random.Random, rate: float, duration: float, start: float = 0.0) -> list[float]:
    """Arrival times of a Poisson process of `rate` per second in [start, start + duration)."""
    if rate <= 0:
        return []
    times, t = [], start
    while True:
        t += rng.expovariate(rate)
        if t >= start + duration:
            return times
        times.append(t)


def _numbered(items: list[tuple[float, str, tuple[dict[str, str], ...], int, int, int | None]],
              warmup: float = 0.0) -> tuple[Request, ...]:
    items.sort(key=lambda item: item[0])
    return tuple(Request(i, at, kind, msgs, max_tokens, tokens, group, at >= warmup)
                 for i, (at, kind, msgs, max_tokens, tokens, group) in enumerate(items))


def _user(content: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": content},)


def mixed(
    seed: int = 1,
    *,
    duration: float = 18.0,
    warmup: float = 6.0,
    rate: float = 17.0,
    long_fraction: float = 0.2,
    short_tokens: int = 32,
    long_tokens: int = 1000,
    prompt_tokens: tuple[int, int] = (64, 512),
) -> Workload:
    """Poisson arrivals; each request is long with probability `long_fraction`, else short.

    Models a chat service where most answers are short and some requests ask for long
    generations (code, documents). The defaults are 64 and 2,000 tokens scaled by 1/2, same ratio.
    Prompts are unique (a unique first word), so the prefix cache cannot help. Arrivals in the first
    `warmup` seconds (about one long generation's service time) are sent but not measured, so the
    measured requests meet backends already holding long generations, as in a steady state.
    """
    rng = random.Random(f"mixed:{seed}")
    items = []
    for n, at in enumerate(poisson_times(rng, rate, warmup + duration)):
        kind = "long" if rng.random() < long_fraction else "short"
        tokens = rng.randint(*prompt_tokens)
        content = text(tokens, rng, head=f"m{seed}-{n}")
        items.append((at, kind, _user(content), long_tokens if kind == "long" else short_tokens, tokens, None))
    params = {"rate_per_s": rate, "long_fraction": long_fraction, "short_tokens": short_tokens,
              "long_tokens": long_tokens, "prompt_tokens": list(prompt_tokens), "warmup_s": warmup}
    return Workload("mixed", f"{1 - long_fraction:.0%} short answers ({short_tokens} tokens), "
                    f"{long_fraction:.0%} long generations ({long_tokens} tokens), Poisson arrivals",
                    duration, _numbered(items, warmup), params, warmup)


def bursts(
    seed: int = 1,
    *,
    duration: float = 15.0,
    background_rate: float = 12.0,
    background_tokens: int = 32,
    background_prompt: tuple[int, int] = (64, 512),
    every: float = 2.0,
    size: int = 8,
    spread: float = 0.05,
    burst_prompt: tuple[int, int] = (2048, 4096),
    burst_tokens: int = 64,
) -> Workload:
    """Interactive Poisson background traffic plus, every `every` seconds, `size` requests with
    long prompts arriving within `spread` seconds of each other (a batch job, a RAG pipeline or
    a document summariser fanning out). The first burst lands at `every / 2`."""
    rng = random.Random(f"bursts:{seed}")
    items = []
    for n, at in enumerate(poisson_times(rng, background_rate, duration)):
        tokens = rng.randint(*background_prompt)
        items.append((at, "background", _user(text(tokens, rng, head=f"b{seed}-{n}")), background_tokens, tokens,
                      None))
    burst, start = 0, every / 2
    while start < duration:
        for k in range(size):
            tokens = rng.randint(*burst_prompt)
            content = text(tokens, rng, head=f"B{seed}-{burst}-{k}")
            items.append((start + rng.uniform(0, spread), "burst", _user(content), burst_tokens, tokens, burst))
        burst += 1
        start += every
    params = {"background_rate_per_s": background_rate, "background_tokens": background_tokens,
              "every_s": every, "size": size, "spread_s": spread, "burst_prompt_tokens": list(burst_prompt),
              "burst_tokens": burst_tokens}
    return Workload("bursts", f"bursts of {size} prompts of {burst_prompt[0]}-{burst_prompt[1]} tokens every "
                    f"{every:g} s over Poisson chat traffic", duration, _numbered(items), params)


def shared_prefix(
    seed: int = 1,
    *,
    duration: float = 12.0,
    rate: float = 30.0,
    groups: int = 8,
    prefix_tokens: int = 2048,
    suffix_tokens: tuple[int, int] = (32, 128),
    max_tokens: int = 32,
) -> Workload:
    """Poisson arrivals, each from one of `groups` groups chosen uniformly; a group's requests share
    a system message of `prefix_tokens` tokens (a long system prompt, or one document many
    questions are asked about), followed by a unique user question."""
    rng = random.Random(f"shared:{seed}")
    prefixes = [text(prefix_tokens, rng, head=f"G{seed}-{g}") for g in range(groups)]
    items = []
    for n, at in enumerate(poisson_times(rng, rate, duration)):
        group = rng.randrange(groups)
        tokens = rng.randint(*suffix_tokens)
        msgs = ({"role": "system", "content": prefixes[group]},
                {"role": "user", "content": text(tokens, rng, head=f"q{seed}-{n}")})
        items.append((at, "shared", msgs, max_tokens, prefix_tokens + tokens, group))
    params = {"rate_per_s": rate, "groups": groups, "prefix_tokens": prefix_tokens,
              "suffix_tokens": list(suffix_tokens), "max_tokens": max_tokens}
    return Workload("shared", f"{groups} groups sharing {prefix_tokens}-token prefixes, Poisson arrivals",
                    duration, _numbered(items), params)


WORKLOADS: dict[str, Callable[..., Workload]] = {"mixed": mixed, "bursts": bursts, "shared": shared_prefix}
