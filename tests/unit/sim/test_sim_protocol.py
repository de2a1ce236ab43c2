"""Token counting, request parsing and response shapes, without a server."""

from __future__ import annotations

import json
from typing import Any

import pytest

from modeldock.sim.config import SimConfig
from modeldock.sim.protocol import DONE_EVENT, ApiError, Job, Reply, parse_job
from modeldock.sim.tokens import render_chat, reply_text, text_prompt, token_ids_prompt, token_text

CONFIG = SimConfig(model="m", max_model_len=100, default_max_tokens=16)


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hello"}], **fields}


def test_text_is_one_token_per_four_characters_at_least_one() -> None:
    assert text_prompt("", 16).num_tokens == 1
    assert text_prompt("abcd", 16).num_tokens == 1
    assert text_prompt("abcde", 16).num_tokens == 2
    assert text_prompt("x" * 400, 16).num_tokens == 100
    assert token_ids_prompt([1, 2, 3], 16).num_tokens == 3


def test_chat_messages_are_rendered_with_a_small_overhead_each() -> None:
    text = render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    assert text == "<|system|>\nbe brief\n<|user|>\nhello\n<|assistant|>\n"
    parts = render_chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}])
    assert parts == "<|user|>\na\n<|assistant|>\n"


def test_prompts_sharing_a_prefix_share_leading_block_hashes() -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    one = text_prompt(render_chat([system, {"role": "user", "content": "first question " * 10}]), 16)
    two = text_prompt(render_chat([system, {"role": "user", "content": "another one " * 10}]), 16)
    shared = 0
    while one.block_hashes[shared] == two.block_hashes[shared]:
        shared += 1
    assert shared == 9  # "<|system|>\n" and the 580-character system prompt fill 9 blocks of 64 characters
    assert one.block_hashes[shared:] != two.block_hashes[shared:]
    # Hashes chain: the same block text after a different prefix hashes differently.
    assert text_prompt("a" * 64 + "b" * 64, 16).block_hashes[1] != text_prompt("c" * 64 + "b" * 64, 16).block_hashes[1]


def test_reply_words_are_deterministic() -> None:
    assert reply_text(3, 4) == "".join(token_text(3, i) for i in range(4))
    assert reply_text(3, 4) == reply_text(3, 4) != reply_text(4, 4)
    assert not token_text(3, 0).startswith(" ") and token_text(3, 1).startswith(" ")


def test_output_length_comes_from_max_tokens_or_the_default() -> None:
    assert parse_job("chat", chat(max_tokens=5), CONFIG).max_tokens == 5
    assert parse_job("chat", chat(max_tokens=5), CONFIG).finish_reason == "length"
    assert parse_job("chat", chat(max_tokens=5, max_completion_tokens=7), CONFIG).max_tokens == 7
    default = parse_job("chat", chat(), CONFIG)
    assert (default.max_tokens, default.finish_reason) == (16, "stop")
    # Near the context limit the default shrinks to what fits, and that is a "length" end.
    near = parse_job("completion", {"prompt": "x" * 360}, CONFIG)
    assert (near.prompt.num_tokens, near.max_tokens, near.finish_reason) == (90, 10, "length")


def test_completion_prompts_may_be_text_or_token_ids() -> None:
    assert parse_job("completion", {"prompt": "abcdefgh"}, CONFIG).prompt.num_tokens == 2
    assert parse_job("completion", {"prompt": [5, 6, 7]}, CONFIG).prompt.num_tokens == 3
    assert parse_job("completion", {"prompt": ["abcdefgh"]}, CONFIG).prompt.num_tokens == 2
    assert parse_job("completion", {"prompt": [[1, 2]]}, CONFIG).prompt.num_tokens == 2


@pytest.mark.parametrize(
    ("kind", "body", "status", "fragment"),
    [
        ("chat", [], 400, "JSON object"),
        ("chat", {"model": "m"}, 400, "messages"),
        ("chat", {"model": "m", "messages": []}, 400, "messages"),
        ("chat", chat(max_tokens="5.5"), 400, "max_tokens"),
        ("chat", chat(max_tokens=5.5), 400, "fractional part"),
        ("chat", chat(max_tokens=0), 400, "max_tokens"),
        ("chat", chat(stream_options={"include_usage": True}), 400, "stream=True"),
        ("chat", chat(n=0), 400, "`n` must be at least 1"),
        ("chat", chat(n=2, best_of=1), 400, "best_of must be greater than or equal to n"),
        ("chat", chat(stream="maybe"), 400, "`stream`"),
        ("chat", chat(stream=2), 400, "`stream`"),
        ("chat", chat(model="other"), 404, "`other` does not exist"),
        ("completion", {"prompt": ["a", 1]}, 400, "prompt"),
        ("completion", {"prompt": [[1], []]}, 400, "prompt"),
        ("completion", {"prompt": []}, 400, "prompt"),
        ("completion", {"prompt": 5}, 400, "prompt"),
        ("completion", {"prompt": "x" * 400}, 400, "maximum context length is 100 tokens"),
        ("completion", {"prompt": "x" * 200, "max_tokens": 51}, 400, "(50 in the messages, 51 in the completion)"),
    ],
)
def test_bad_requests_are_rejected_like_vllm(kind: Any, body: Any, status: int, fragment: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_job(kind, body, CONFIG)
    assert info.value.status == status
    assert fragment in info.value.message
    error = info.value.body()["error"]
    assert error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


def test_missing_model_is_accepted_as_vllm_does() -> None:
    assert parse_job("completion", {"prompt": "hi"}, CONFIG).max_tokens == 16


def _event_json(event: bytes) -> Any:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    return json.loads(event[len(b"data: ") : -2])


def test_chat_events_match_vllm_chunks() -> None:
    job = parse_job("chat", chat(max_tokens=2, stream=True, stream_options={"include_usage": True}), CONFIG)
    reply = Reply(job, "chatcmpl-1", "m", 123)
    role = _event_json(reply.role_event())
    assert role["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    first = _event_json(reply.token_event(0, None))
    assert first["id"] == "chatcmpl-1" and first["object"] == "chat.completion.chunk"
    assert first["created"] == 123 and first["model"] == "m"
    assert first["choices"][0]["delta"] == {"content": token_text(job.seed, 0)}
    assert first["choices"][0]["finish_reason"] is None
    last = _event_json(reply.token_event(1, "length"))
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["stop_reason"] is None
    usage = _event_json(reply.usage_event(2))
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": job.prompt.num_tokens, "completion_tokens": 2,
                              "total_tokens": job.prompt.num_tokens + 2}
    assert DONE_EVENT == b"data: [DONE]\n\n"


def test_completion_events_and_whole_replies() -> None:
    job: Job = parse_job("completion", {"model": "m", "prompt": 'say "hi"\n', "max_tokens": 3}, CONFIG)
    reply = Reply(job, "cmpl-1", "m", 5)
    event = _event_json(reply.token_event(2, "length"))
    assert event["object"] == "text_completion"
    assert event["choices"][0]["text"] == token_text(job.seed, 2)
    whole = reply.full([(3, "length")])
    assert whole["choices"][0]["text"] == reply_text(job.seed, 3)
    assert whole["usage"]["completion_tokens"] == 3
    chat_whole = Reply(parse_job("chat", chat(), CONFIG), "chatcmpl-2", "m", 5).full([(2, "stop")])
    assert chat_whole["object"] == "chat.completion"
    assert chat_whole["choices"][0]["message"]["role"] == "assistant"
    assert chat_whole["choices"][0]["finish_reason"] == "stop"


def test_seed_parameter_picks_the_words() -> None:
    assert parse_job("chat", chat(seed=42), CONFIG).seed == 42
    assert parse_job("chat", chat(), CONFIG).seed == parse_job("chat", chat(), CONFIG).seed
