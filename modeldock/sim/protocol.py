"""OpenAI request parsing and response bodies, shaped like vLLM's.

Pure functions and small classes: no I/O, so they are tested without a server.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import TypeAdapter, ValidationError

from modeldock.sim.config import SimConfig
from modeldock.sim.tokens import Prompt, render_chat, reply_text, text_prompt, token_ids_prompt, token_text

Kind = Literal["chat", "completion"]


class ApiError(Exception):
    """An error answer in vLLM's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": self.status}}


def bad_request(message: str) -> ApiError:
    return ApiError(400, message, "BadRequestError")


# vLLM's request models are pydantic models in lax mode; parsing each field with pydantic's own lax
# types accepts exactly what vLLM accepts: 5000.0 and "5000" as an int, "true"/"1"/1/"yes"/"on" as a bool.
_INT = TypeAdapter(Optional[int])  # noqa: UP045 (a runtime type for pydantic)
_BOOL = TypeAdapter(Optional[bool])  # noqa: UP045
# CompletionRequest.prompt: Union[list[int], list[list[int]], str, list[str]].
_PROMPT = TypeAdapter(Optional[Union[list[int], list[list[int]], str, list[str]]])  # noqa: UP007, UP045
# A simulator guard, not vLLM's: prompts x max(n, best_of) sequences in one request.
MAX_SEQUENCES = 10_000


@dataclass(frozen=True)
class Choice:
    """One sequence in the engine: a (prompt, sample) pair of a request."""

    index: int  # the choice's `index` as vLLM numbers it (prompt_index * n + sample); -1 when not returned
    prompt_index: int
    prompt: Prompt
    max_tokens: int
    finish_reason: str  # "length" when the client's max_tokens bounds the reply, else "stop"
    seed: int  # picks the words: the prompt's (or the request's) seed + the sample number
    returned: bool = True  # False for the best_of samples beyond n: generated, never sent


@dataclass(frozen=True)
class Job:
    kind: Kind
    prompts: tuple[Prompt, ...]
    choices: tuple[Choice, ...]  # prompt-major, every sample of a prompt (best_of of them) in order
    n: int
    stream: bool
    include_usage: bool

    @property
    def prompt(self) -> Prompt:
        return self.prompts[0]

    @property
    def max_tokens(self) -> int:
        return self.choices[0].max_tokens

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason

    @property
    def seed(self) -> int:
        return self.choices[0].seed

    @property
    def prompt_tokens(self) -> int:
        """Usage's prompt_tokens: each prompt once, whatever n (as vLLM)."""
        return sum(p.num_tokens for p in self.prompts)


def parse_job(kind: Kind, body: Any, config: SimConfig) -> Job:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("`messages` must be a non-empty list of message objects.")
        prompts: tuple[Prompt, ...] = (text_prompt(render_chat(messages), config.block_size),)
        requested = _lax_int(body, "max_completion_tokens")
        if requested is None:
            requested = _lax_int(body, "max_tokens")
    else:
        prompts = _completion_prompts(body.get("prompt"), config.block_size)
        requested = _lax_int(body, "max_tokens")

    stream = _lax(_BOOL, body, "stream") or False
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("Stream options can only be defined when `stream=True`.")
        if not isinstance(options, dict):
            raise bad_request("`stream_options` must be an object.")
    include_usage = bool(options and options.get("include_usage"))
    n = _lax_int(body, "n")
    n = 1 if n is None else n
    best_of = _lax_int(body, "best_of")
    if best_of is not None and best_of < n:
        raise bad_request(f"best_of must be greater than or equal to n, got n={n} and best_of={best_of}.")
    samples = n if best_of is None else best_of
    if samples * len(prompts) > MAX_SEQUENCES:
        raise bad_request(f"The simulator runs at most {MAX_SEQUENCES} sequences a request "
                          f"({len(prompts)} prompts x {samples} samples asked).")
    seed = _lax_int(body, "seed", minimum=None)

    model = body.get("model")
    if model is not None and model != config.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")

    choices: list[Choice] = []
    for i, prompt in enumerate(prompts):
        max_tokens, finish_reason = _output_limit(prompt, requested, config)
        base = prompt.seed if seed is None else seed
        for j in range(samples):
            returned = j < n
            choices.append(Choice(i * n + j if returned else -1, i, prompt, max_tokens, finish_reason,
                                  base + j, returned))
    return Job(kind, prompts, tuple(choices), n, stream, include_usage)


def _output_limit(prompt: Prompt, requested: int | None, config: SimConfig) -> tuple[int, str]:
    limit = config.max_model_len
    if requested is None:
        if prompt.num_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt.num_tokens} input tokens. Please reduce the length of the input messages."
            )
        max_tokens = min(config.default_max_tokens, limit - prompt.num_tokens)
        return max_tokens, "stop" if max_tokens == config.default_max_tokens else "length"
    if prompt.num_tokens + requested > limit:
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt.num_tokens + requested} tokens ({prompt.num_tokens} in the messages, {requested} "
            "in the completion). Please reduce the length of the messages or completion."
        )
    return requested, "length"


def _lax(adapter: TypeAdapter[Any], body: dict[str, Any], name: str) -> Any:
    try:
        return adapter.validate_python(body.get(name))
    except ValidationError as exc:
        # pydantic's message, never the value (as vLLM's 400 names the field and the reason).
        raise bad_request(f"`{name}`: {exc.errors(include_url=False)[0]['msg']}.") from None


def _lax_int(body: dict[str, Any], name: str, minimum: int | None = 1) -> int | None:
    value: int | None = _lax(_INT, body, name)
    if value is not None and minimum is not None and value < minimum:
        raise bad_request(f"`{name}` must be at least {minimum}, got {value}.")
    return value


def _completion_prompts(prompt: Any, block_size: int) -> tuple[Prompt, ...]:
    # A string, token ids, or a list of either: each an own prompt, answered by its own choices.
    parsed: Any
    try:
        parsed = _PROMPT.validate_python(prompt)
    except ValidationError:
        parsed = None
    if isinstance(parsed, str):
        return (text_prompt(parsed, block_size),)
    if isinstance(parsed, list) and parsed and all(isinstance(t, int) for t in parsed):
        return (token_ids_prompt(parsed, block_size),)
    if isinstance(parsed, list) and parsed and all(isinstance(p, str) for p in parsed):
        return tuple(text_prompt(p, block_size) for p in parsed)
    if isinstance(parsed, list) and parsed and all(isinstance(p, list) and p for p in parsed):
        return tuple(token_ids_prompt(p, block_size) for p in parsed)
    raise bad_request("`prompt` must be a string, a non-empty list of token ids, or a non-empty list of either.")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


class Reply:
    """Builds one request's response bodies and SSE events; each event carries one choice, as vLLM's."""

    def __init__(self, job: Job, request_id: str, model: str, created: int) -> None:
        self.job = job
        self.id = request_id
        self.model = model
        self.created = created
        chunk_object = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
        self._head = {"id": request_id, "object": chunk_object, "created": created, "model": model}
        self._templates: dict[int, tuple[str, str, str]] = {}

    def _template(self, index: int) -> tuple[str, str, str]:
        # Token events are built from a template cut once per choice, so each token costs
        # one json.dumps of its text and a few concatenations.
        cut = self._templates.get(index)
        if cut is None:
            choice: dict[str, Any]
            if self.job.kind == "chat":
                choice = {"index": index, "delta": {"content": "\x00"}, "logprobs": None, "finish_reason": "\x01"}
            else:
                choice = {"index": index, "text": "\x00", "logprobs": None, "finish_reason": "\x01"}
            template = json.dumps({**self._head, "choices": [choice]}, separators=(",", ":"))
            before_text, rest = template.split('"\\u0000"')
            before_reason, after_reason = rest.split('"\\u0001"')
            cut = self._templates[index] = (before_text, before_reason, after_reason)
        return cut

    def role_event(self, index: int = 0) -> bytes:
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return _event({**self._head, "choices": [choice]})

    def token_event(self, index: int, finish_reason: str | None, choice: Choice | None = None) -> bytes:
        """Token `index` of `choice` (default: the first)."""
        choice = choice or self.job.choices[0]
        before_text, before_reason, after_reason = self._template(choice.index)
        text = json.dumps(token_text(choice.seed, index))
        reason = "null" if finish_reason is None else f'"{finish_reason}","stop_reason":null'
        return f"data: {before_text}{text}{before_reason}{reason}{after_reason}\n\n".encode()

    def usage_event(self, completion_tokens: int) -> bytes:
        return _event({**self._head, "choices": [], "usage": usage(self.job.prompt_tokens, completion_tokens)})

    def full(self, outputs: Sequence[tuple[int, str]]) -> dict[str, Any]:
        """The whole reply; `outputs` has (tokens, finish_reason) per returned choice, in index order."""
        returned = [c for c in self.job.choices if c.returned]
        if len(outputs) != len(returned):
            raise ValueError(f"{len(outputs)} outputs for {len(returned)} choices")
        choices: list[dict[str, Any]] = []
        for choice, (tokens, finish_reason) in zip(returned, outputs, strict=True):
            text = reply_text(choice.seed, tokens)
            if self.job.kind == "chat":
                choices.append({"index": choice.index,
                                "message": {"role": "assistant", "content": text, "tool_calls": []},
                                "logprobs": None, "finish_reason": finish_reason, "stop_reason": None})
            else:
                choices.append({"index": choice.index, "text": text, "logprobs": None,
                                "finish_reason": finish_reason, "stop_reason": None})
        return {
            "id": self.id,
            "object": "chat.completion" if self.job.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(self.job.prompt_tokens, sum(tokens for tokens, _ in outputs)),
        }


DONE_EVENT = b"data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
