"""OpenAI request parsing and response bodies, shaped like vLLM's.

Pure functions and small classes: no I/O, so they are tested without a server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from modeldock.sim.config import SimConfig
from modeldock.sim.tokens import Prompt, render_chat, text_prompt, token_ids_prompt, token_text

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


@dataclass(frozen=True)
class Job:
    kind: Kind
    prompt: Prompt
    max_tokens: int
    finish_reason: str  # "length" when the client's max_tokens bounds the reply, else "stop"
    stream: bool
    include_usage: bool
    seed: int


def parse_job(kind: Kind, body: Any, config: SimConfig) -> Job:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("`messages` must be a non-empty list of message objects.")
        prompt = text_prompt(render_chat(messages), config.block_size)
        requested = _optional_int(body, "max_completion_tokens")
        if requested is None:
            requested = _optional_int(body, "max_tokens")
    else:
        prompt = _completion_prompt(body.get("prompt"), config.block_size)
        requested = _optional_int(body, "max_tokens")

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean.")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request("Stream options can only be defined when `stream=True`.")
        if not isinstance(options, dict):
            raise bad_request("`stream_options` must be an object.")
    include_usage = bool(options and options.get("include_usage"))
    n = body.get("n", 1)
    if n not in (None, 1):
        raise bad_request("The simulator answers with one choice only (n=1).")
    seed = _optional_int(body, "seed", minimum=None)

    model = body.get("model")
    if model is not None and model != config.model:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")

    limit = config.max_model_len
    if requested is None:
        if prompt.num_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{prompt.num_tokens} input tokens. Please reduce the length of the input messages."
            )
        max_tokens = min(config.default_max_tokens, limit - prompt.num_tokens)
        finish_reason = "stop" if max_tokens == config.default_max_tokens else "length"
    else:
        if prompt.num_tokens + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt.num_tokens + requested} tokens ({prompt.num_tokens} in the messages, {requested} "
                "in the completion). Please reduce the length of the messages or completion."
            )
        max_tokens = requested
        finish_reason = "length"
    return Job(kind, prompt, max_tokens, finish_reason, stream, include_usage, prompt.seed if seed is None else seed)


def _optional_int(body: dict[str, Any], name: str, minimum: int | None = 1) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"`{name}` must be an integer.")
    if minimum is not None and value < minimum:
        raise bad_request(f"`{name}` must be at least {minimum}, got {value}.")
    return value


def _completion_prompt(prompt: Any, block_size: int) -> Prompt:
    # One prompt per request: a string, token ids, or a one-element batch of either.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return text_prompt(prompt, block_size)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return token_ids_prompt(prompt, block_size)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("The simulator takes one prompt per request; batched prompts are not supported.")
    raise bad_request("`prompt` must be a string or a non-empty list of token ids.")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


class Reply:
    """Builds one request's response bodies and SSE events."""

    def __init__(self, job: Job, request_id: str, model: str, created: int) -> None:
        self.job = job
        self.id = request_id
        self.model = model
        self.created = created
        chunk_object = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
        self._head = {"id": request_id, "object": chunk_object, "created": created, "model": model}
        # Token events are built from a template cut once per request, so each token costs
        # one json.dumps of its text and a few concatenations.
        if job.kind == "chat":
            delta = {"content": "\x00"}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": "\x01"}
        else:
            choice = {"index": 0, "text": "\x00", "logprobs": None, "finish_reason": "\x01"}
        template = json.dumps({**self._head, "choices": [choice]}, separators=(",", ":"))
        self._before_text, rest = template.split('"\\u0000"')
        self._before_reason, self._after_reason = rest.split('"\\u0001"')

    def role_event(self) -> bytes:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return _event({**self._head, "choices": [choice]})

    def token_event(self, index: int, finish_reason: str | None) -> bytes:
        text = json.dumps(token_text(self.job.seed, index))
        reason = "null" if finish_reason is None else f'"{finish_reason}","stop_reason":null'
        return f"data: {self._before_text}{text}{self._before_reason}{reason}{self._after_reason}\n\n".encode()

    def usage_event(self, completion_tokens: int) -> bytes:
        return _event({**self._head, "choices": [], "usage": usage(self.job.prompt.num_tokens, completion_tokens)})

    def full(self, completion_tokens: int, finish_reason: str) -> dict[str, Any]:
        text = "".join(token_text(self.job.seed, i) for i in range(completion_tokens))
        choice: dict[str, Any]
        if self.job.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(self.job.prompt.num_tokens, completion_tokens),
        }


DONE_EVENT = b"data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
