"""Request cost: prompt characters / 4 plus the output limit, robust to odd bodies."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from modeldock.flowcontrol import QueueConfig, estimate_cost
from modeldock.flowcontrol.cost import request_cost


def test_chat_text_and_multipart_content_count_with_message_overhead() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "x" * 40},
            {"role": "user", "content": [{"type": "text", "text": "y" * 80}, {"type": "image_url", "image_url": {}}]},
        ],
        "max_tokens": 100,
    }
    cost = estimate_cost(body, default_max_tokens=7)
    assert cost.prompt_tokens == 120 // 4 + 2 * 3
    assert cost.max_new_tokens == 100
    assert cost.total == cost.prompt_tokens + 100


def test_max_completion_tokens_wins_in_chat_and_default_fills_in() -> None:
    chat = [{"role": "user", "content": "abcd"}]
    assert estimate_cost({"messages": chat, "max_tokens": 5, "max_completion_tokens": 9}, 7).max_new_tokens == 9
    # /v1/completions has no max_completion_tokens in vLLM: the backend reads max_tokens.
    assert estimate_cost({"prompt": "abcd", "max_tokens": 5, "max_completion_tokens": 9}, 7).max_new_tokens == 5
    assert estimate_cost({"prompt": "abcd"}, 7).max_new_tokens == 7
    # Forms vLLM's lax parse takes count as it counts them; the lenient read never raises.
    assert estimate_cost({"prompt": "abcd", "max_tokens": "12"}, 7).max_new_tokens == 12
    for bad in (0, -3, 1.5, None, "x"):
        assert estimate_cost({"prompt": "abcd", "max_tokens": bad}, 7).max_new_tokens == 7


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [("a" * 9, 3), (["a" * 8, "b" * 4], 3), ([1, 2, 3, 4, 5], 5), ([[1, 2], [3, 4, 5]], 5), ({"odd": 1}, 1)],
)
def test_completion_prompt_shapes(prompt: Any, tokens: int) -> None:
    assert estimate_cost({"prompt": prompt}, 1).prompt_tokens == tokens


def test_longer_prompt_costs_more() -> None:
    short = estimate_cost({"messages": [{"role": "user", "content": "hi"}]}, 16)
    long = estimate_cost({"messages": [{"role": "user", "content": "hi" * 1000}]}, 16)
    assert long.total > short.total + 400


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(["messages", "prompt", "max_tokens", "max_completion_tokens", "model", "content"]),
        json_values,
    )
)
def test_never_raises_on_any_json_object(body: dict[str, Any]) -> None:
    cost = estimate_cost(body, QueueConfig().default_max_tokens)
    assert cost.prompt_tokens >= 1
    assert cost.max_new_tokens >= 1


def test_one_estimator_for_picking_and_budgets() -> None:
    body = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 30, "n": 2}
    text = estimate_cost(body, 7)
    assert text.prompt_tokens == 100 + 3 and text.max_new_tokens == 60  # n choices each generate
    by_bytes = estimate_cost(body, 7, body_bytes=1000)
    assert by_bytes.prompt_tokens == 250 and by_bytes.max_new_tokens == 60
    # The director's one estimate carries both prompts: the text's for picking, the bytes' for budgets.
    once, _ = request_cost(dict(body), 1000, chat=True, default_per_choice=7)
    assert (once.prompt_tokens, once.prompt_bound, once.max_new_tokens) == (103, 250, 60)
    assert once.bounded(10).max_new_tokens == 20 and once.bounded(10).prompt_bound == 250
    assert estimate_cost({"prompt": "a", "n": 1000}, 7).max_new_tokens == 7000  # any n: each choice generates
