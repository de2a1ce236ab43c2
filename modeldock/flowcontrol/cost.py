"""A request's token cost, estimated from its parsed OpenAI body without a tokenizer.

Runs on the hot path for every queued request, so it only walks the body once and
counts characters: ~4 characters per token is the usual figure for English with
Llama-3-class tokenizers (the simulator cuts tokens the same way). It never raises
on a body the parser accepted; odd fields count as zero.

The one estimator of the gateway: the director computes it once per request (picking,
committed tokens, the queue's fairness), and token budgets (admission/tokens.py) call it
with `body_bytes`, which makes the prompt the body's bytes / 4: deliberately high, since a
budget's settlement gives back what was not used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4
MAX_CHOICES = 128
# Chat templates add role markers around each message; ~3 tokens with Llama-3's template.
MESSAGE_OVERHEAD_TOKENS = 3


@dataclass(frozen=True, slots=True)
class RequestCost:
    prompt_tokens: int
    max_new_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.max_new_tokens


def _text_chars(content: Any) -> int:
    """Characters of text in a message's content: a string or a list of parts."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    total += len(text)
        return total
    return 0


def _prompt_tokens(body: Mapping[str, Any]) -> int:
    messages = body.get("messages")
    if isinstance(messages, list):
        chars = 0
        count = 0
        for message in messages:
            if isinstance(message, Mapping):
                count += 1
                chars += _text_chars(message.get("content"))
        return -(-chars // CHARS_PER_TOKEN) + MESSAGE_OVERHEAD_TOKENS * count
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return -(-len(prompt) // CHARS_PER_TOKEN)
    if isinstance(prompt, list):
        tokens = 0
        for entry in prompt:
            if isinstance(entry, str):
                tokens += -(-len(entry) // CHARS_PER_TOKEN)
            elif isinstance(entry, int) and not isinstance(entry, bool):
                tokens += 1  # a list of token ids
            elif isinstance(entry, list):
                tokens += len(entry)  # a batch of token-id lists
        return tokens
    return 0


def _limit(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def estimate_cost(body: Mapping[str, Any], default_max_tokens: int, *, body_bytes: int | None = None) -> RequestCost:
    """Prompt tokens (estimated) plus the output tokens the request may generate.

    `max_completion_tokens` wins over `max_tokens` (OpenAI's newer name); with
    neither, or a value that is not a positive integer, `default_max_tokens`; times
    `n` (1 to 128) choices. The prompt is counted from its text (at least 1 token), or,
    given `body_bytes`, as the body's bytes / 4 (an upper bound, for budgets).
    """
    if body_bytes is None:
        prompt = max(1, _prompt_tokens(body))
    else:
        prompt = -(-max(body_bytes, 0) // CHARS_PER_TOKEN)
    limit = _limit(body.get("max_completion_tokens")) or _limit(body.get("max_tokens"))
    n = _limit(body.get("n"))
    choices = n if n is not None and n <= MAX_CHOICES else 1
    return RequestCost(prompt_tokens=prompt, max_new_tokens=(limit or default_max_tokens) * choices)
