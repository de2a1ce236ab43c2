"""The output bound as the backend reads it (flowcontrol.cost.read_output_limit), the limit a budgeted
request carries upstream (gateway.billing.bound_output) and the stream flag checks (gateway.request)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, ValidationError

from modeldock.errors import BadRequest
from modeldock.flowcontrol.cost import OutputLimit, estimate_cost, read_output_limit
from modeldock.gateway.billing import bound_output
from modeldock.gateway.request import parse_body


class _VllmLike(BaseModel):
    """The fields as vLLM's request models declare them (pydantic, lax mode): the reference parse."""

    model_config = ConfigDict(extra="allow")
    max_tokens: int | None = None
    n: int | None = 1


@pytest.mark.parametrize("value,expected", [(5000.0, 5000), ("5000", 5000), (" 5000 ", 5000), ("5_000", 5000),
                                            (7, 7), (True, 1)])
def test_max_tokens_in_every_form_the_backend_takes_counts_as_it_counts(value: Any, expected: int) -> None:
    body: dict[str, Any] = {"messages": [], "max_tokens": value}
    limit, changed = read_output_limit(body, chat=True)
    assert limit == OutputLimit(expected, 1) == OutputLimit(_VllmLike(max_tokens=value).max_tokens, 1)
    assert body["max_tokens"] == expected and type(body["max_tokens"]) is int  # written back as counted
    assert changed is (type(value) is not int)


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 5000.5),
                                         ("max_tokens", "1e3"), ("max_tokens", [1]), ("n", 0), ("n", "two"),
                                         ("max_completion_tokens", {"a": 1}), ("best_of", -1)])
def test_a_limit_that_cannot_be_counted_is_a_400_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(BadRequest) as err:
        read_output_limit({"messages": [], field: value}, chat=True)
    assert err.value.param == field and f"`{field}`" in err.value.message and err.value.status == 400


def test_any_n_and_best_of_count_every_sequence() -> None:
    assert read_output_limit({"n": 250, "max_tokens": 20}, chat=True)[0].tokens(7) == 5000
    assert read_output_limit({"n": 2, "best_of": 5, "max_tokens": 10}, chat=False)[0].tokens(7) == 50
    with pytest.raises(BadRequest) as err:
        read_output_limit({"n": 3, "best_of": 2}, chat=False)
    assert err.value.param == "best_of"


def test_a_prompt_list_is_one_completion_per_prompt() -> None:
    assert read_output_limit({"prompt": ["a"] * 50, "max_tokens": 100}, chat=False)[0] == OutputLimit(100, 50)
    assert read_output_limit({"prompt": [[1, 2], [3]], "n": 2}, chat=False)[0] == OutputLimit(None, 4)
    assert read_output_limit({"prompt": [1, 2, 3], "max_tokens": 4}, chat=False)[0] == OutputLimit(4, 1)  # token ids


def test_the_chat_limit_is_max_completion_tokens_else_max_tokens_and_completions_read_only_max_tokens() -> None:
    assert read_output_limit({"max_completion_tokens": 9, "max_tokens": 50}, chat=True)[0].per_choice == 9
    # vLLM's completions request has no max_completion_tokens: the backend ignores it there.
    assert read_output_limit({"max_completion_tokens": 9}, chat=False)[0].per_choice is None
    assert read_output_limit({"max_completion_tokens": "bad"}, chat=False)[0].per_choice is None


def test_bound_output_writes_in_a_limit_or_lowers_one_and_says_why() -> None:
    body: dict[str, Any] = {"messages": []}
    bound = bound_output(body, OutputLimit(None, 1), 64, capped=False, chat=True)
    assert (bound.per_choice, bound.reason, body["max_tokens"]) == (64, "default", 64)
    body = {"messages": [], "max_completion_tokens": 5000, "max_tokens": 5000}
    bound = bound_output(body, OutputLimit(5000, 1), 1900, capped=True, chat=True)
    assert (bound.reason, body["max_completion_tokens"], body["max_tokens"]) == ("budget", 1900, 1900)
    body = {"prompt": ["a"] * 3, "max_tokens": 100, "n": 2}
    bound = bound_output(body, OutputLimit(100, 6), 100, capped=True, chat=False)
    assert (bound.per_choice, body["max_tokens"]) == (16, 16)  # 16 x 6 choices <= the 100 reserved
    body = {"messages": [], "max_tokens": 7}
    assert bound_output(body, OutputLimit(7, 1), 7, capped=False, chat=True).reason == ""
    assert body == {"messages": [], "max_tokens": 7}


@pytest.mark.parametrize("extra", [{"stream": "true"}, {"stream": 1}, {"stream": "1"},
                                   {"stream": True, "stream_options": "yes"},
                                   {"stream": True, "stream_options": {"include_usage": "true"}}])
def test_stream_flags_must_be_json_booleans(extra: dict[str, Any]) -> None:
    import json

    with pytest.raises(BadRequest) as err:
        parse_body(json.dumps({"model": "m", **extra}).encode())
    assert err.value.code == "invalid_value" and err.value.param is not None
    assert err.value.body()["error"]["param"] == err.value.param


@given(st.dictionaries(st.sampled_from(["max_tokens", "max_completion_tokens", "n", "best_of", "prompt"]),
                       st.one_of(st.integers(-5, 10**6), st.floats(allow_nan=False), st.text(max_size=8),
                                 st.booleans(), st.none(), st.lists(st.text(max_size=3), max_size=5))))
def test_the_count_is_never_below_what_the_backend_would_be_allowed(fields: dict[str, Any]) -> None:
    """Whenever the backend's own parse accepts the limits, the gateway counts at least its output bound;
    when the gateway refuses, it says which field."""
    body = dict(fields)
    try:
        limit, _ = read_output_limit(body, chat=False)
    except BadRequest as err:
        assert err.param in fields
        return
    try:
        parsed = _VllmLike.model_validate(fields)
    except ValidationError:
        return  # the backend would refuse it too
    prompts = len(fields["prompt"]) if isinstance(fields.get("prompt"), list) and fields["prompt"] else 1
    if parsed.max_tokens is not None:
        assert limit.tokens(1) >= parsed.max_tokens * (parsed.n or 1) * prompts
    assert estimate_cost(body, 16, limit=limit).max_new_tokens == limit.tokens(16)
