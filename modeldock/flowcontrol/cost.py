"""A request's token cost, estimated from its parsed OpenAI body without a tokenizer.

Runs on the hot path for every queued request, so it only walks the body once and
counts characters: ~4 characters per token is the usual figure for English with
Llama-3-class tokenizers (the simulator cuts tokens the same way). It never raises
on a body the parser accepted; odd fields count as zero.

The one estimator of the gateway: the director computes one `RequestCost` per request right after
parsing (`request_cost`), which the token budgets (its `prompt_bound`, the body's bytes / 4:
deliberately high, since a budget's settlement gives back what was not used), the queue's fairness
and the picker's committed tokens all read. `estimate_cost` is the same count, read leniently, for
tools and benchmarks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from modeldock.errors import BadRequest

CHARS_PER_TOKEN = 4
# Chat templates add role markers around each message; ~3 tokens with Llama-3's template.
MESSAGE_OVERHEAD_TOKENS = 3


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


# vLLM's request models are pydantic in lax mode: an integer field takes 5000.0, "5000", " 5_000 ", True.
# The gateway reads them with the same parser, so that what it counts is what the backend will do.
_LAX_INT: TypeAdapter[int] = TypeAdapter(int)
# The fields whose value bounds what the backend may generate.
LIMIT_FIELDS = ("max_completion_tokens", "max_tokens", "n", "best_of")


@dataclass(frozen=True, slots=True)
class OutputLimit:
    """What bounds a request's output, read as the backend reads it (`read_output_limit`)."""

    per_choice: int | None  # max_completion_tokens (chat) or max_tokens; None: the client set none
    choices: int  # sequences the backend generates: prompts x max(n, best_of)

    def tokens(self, default_per_choice: int) -> int:
        """Output tokens the request may generate, all sequences, with `default_per_choice` when unset."""
        return (self.per_choice if self.per_choice is not None else default_per_choice) * self.choices


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestCost:
    """A request's token cost, computed once after parsing (`request_cost`) and read by the token
    budgets (`prompt_bound`, `limit`), the queue's fairness and the picker's committed tokens (`total`,
    `max_new_tokens`)."""

    prompt_tokens: int  # the prompt, counted from its text (at least 1)
    max_new_tokens: int  # output tokens it may generate, all choices (the limit, else the default per choice)
    prompt_bound: int = 0  # the body's bytes / 4: the budgets' prompt estimate, an upper bound (0: not known)
    limit: OutputLimit = OutputLimit(None, 1)  # the client's output bound, as the backend reads it

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.max_new_tokens

    def bounded(self, per_choice: int) -> RequestCost:
        """The cost once the gateway set the body's output limit to `per_choice` (billing.bound_output)."""
        limit = OutputLimit(per_choice, self.limit.choices)
        return RequestCost(prompt_tokens=self.prompt_tokens, max_new_tokens=limit.tokens(0),
                           prompt_bound=self.prompt_bound, limit=limit)


def _lax_int(body: Mapping[str, Any], name: str, strict: bool) -> int | None:
    """The field as vLLM reads it, or None when absent (or null). Strict: a value vLLM would refuse, or a
    count below 1, is a 400 naming the field; lenient: such a value counts as absent."""
    value = body.get(name)
    if value is None:
        return None
    if type(value) is int:  # the usual case, without the parser
        number: int | None = value
    else:
        try:
            number = _LAX_INT.validate_python(value)
        except ValidationError:
            number = None
    if number is not None and number >= 1:
        return number
    if not strict:
        return None
    raise BadRequest(f"`{name}` must be a positive integer.", code="invalid_value", param=name)


def _prompts(body: Mapping[str, Any]) -> int:
    """Prompts in a request: a /v1/completions `prompt` list of strings or of token-id lists is a batch
    (one completion each); a list of token ids, a string or chat messages is one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(e, int) for e in prompt):
        return len(prompt)
    return 1


def read_output_limit(body: dict[str, Any], *, chat: bool, strict: bool = True) -> tuple[OutputLimit, bool]:
    """The request's output bound, and whether the body was rewritten to the canonical integers counted.

    As vLLM reads them: on /v1/chat/completions `max_completion_tokens or max_tokens`, on /v1/completions
    `max_tokens` (vLLM ignores the other name there); `n` and `best_of` any positive integer, the backend
    generating max(n, best_of) sequences per prompt. A value in another form vLLM accepts (5000.0, "5000")
    is written back as the integer, so that the backend sees exactly what was counted (strict only).
    """
    changed = False
    values: dict[str, int | None] = {}
    for name in LIMIT_FIELDS:
        if name == "max_completion_tokens" and not chat:
            values[name] = None
            continue
        number = values[name] = _lax_int(body, name, strict)
        if strict and number is not None and type(body[name]) is not int:
            body[name] = number
            changed = True
    per_choice = values["max_completion_tokens"] or values["max_tokens"]
    n = values["n"] or 1
    best_of = values["best_of"]
    if strict and best_of is not None and best_of < n:
        raise BadRequest("`best_of` must be at least `n`.", code="invalid_value", param="best_of")
    choices = max(n, best_of or 1) * _prompts(body)
    return OutputLimit(per_choice, choices), changed


def write_output_limit(body: dict[str, Any], per_choice: int, *, chat: bool) -> None:
    """Set the output limit the backend will read to `per_choice`: every limit field the client sent that
    the backend reads, or `max_tokens` when it sent none."""
    wrote = False
    for name in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        if body.get(name) is not None:
            body[name] = per_choice
            wrote = True
    if not wrote:
        body["max_tokens"] = per_choice


def _bytes_tokens(body_bytes: int) -> int:
    """A body's bytes / 4, rounded up: the budgets' prompt estimate, an upper bound."""
    return -(-max(body_bytes, 0) // CHARS_PER_TOKEN)


def request_cost(body: dict[str, Any], body_bytes: int, *, chat: bool, default_per_choice: int
                 ) -> tuple[RequestCost, bool]:
    """The director's one estimate of a parsed request (strict: a limit vLLM would refuse is a 400 naming
    the field), and whether reading its limit rewrote the body (read_output_limit)."""
    limit, normalised = read_output_limit(body, chat=chat)
    return RequestCost(prompt_tokens=max(1, _prompt_tokens(body)), max_new_tokens=limit.tokens(default_per_choice),
                       prompt_bound=_bytes_tokens(body_bytes), limit=limit), normalised


def estimate_cost(body: Mapping[str, Any], default_max_tokens: int, *, body_bytes: int | None = None,
                  limit: OutputLimit | None = None) -> RequestCost:
    """Prompt tokens (estimated) plus the output tokens the request may generate, read leniently (for
    tools and benchmarks; never raises, never writes to the body).

    The output is `limit` (from `read_output_limit`), else read leniently from the body (a value that is
    not a positive integer counts as unset); `default_max_tokens` per choice when no limit is set. The
    prompt is counted from its text (at least 1 token), or, given `body_bytes`, as the body's bytes / 4
    (an upper bound, for budgets).
    """
    bound = 0 if body_bytes is None else _bytes_tokens(body_bytes)
    prompt = max(1, _prompt_tokens(body)) if body_bytes is None else bound
    if limit is None:
        limit, _ = read_output_limit(body if isinstance(body, dict) else dict(body), chat="messages" in body,
                                     strict=False)
    return RequestCost(prompt_tokens=prompt, max_new_tokens=limit.tokens(default_max_tokens), prompt_bound=bound,
                       limit=limit)
