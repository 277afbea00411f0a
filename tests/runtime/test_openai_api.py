"""OpenAI request validation: parameters the engine cannot honour are a 400 naming them, the
harmless ones are accepted (no IO: ``runtime/openai_api.py`` alone)."""

from __future__ import annotations

from typing import Any

import pytest

from radixmesh.runtime.openai_api import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    ApiError,
    parse_chat,
    parse_completion,
)

MODELS = ["tiny"]
MSGS = [{"role": "user", "content": "hi"}]


def _refused(parse: Any, extra: dict[str, Any]) -> ApiError:
    base: dict[str, Any] = {"model": "tiny"}
    base.update({"messages": MSGS} if parse is parse_chat else {"prompt": "x"})
    with pytest.raises(ApiError) as info:
        parse({**base, **extra}, MODELS)
    err = info.value
    error = err.body()["error"]
    assert err.status == 400 and isinstance(error, dict)
    assert set(error) == {"message", "type", "param", "code"}
    return err


TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [TOOL]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"response_format": "text"}, "response_format"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"n": 2}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": 0}, "logprobs"),
        ({"logprobs": 3}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"echo": True}, "echo"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
    ],
)
def test_unsupported_parameters_are_a_400_naming_them(parse: Any, extra: dict[str, Any],
                                                      param: str) -> None:
    err = _refused(parse, extra)
    assert err.param == param
    assert param in err.message


def test_penalties_say_they_are_not_supported_yet() -> None:
    err = _refused(parse_completion, {"presence_penalty": 1.0})
    assert err.code == "unsupported_value" and "not supported yet" in err.message


def test_suffix_and_tool_calls_in_messages_are_refused() -> None:
    assert _refused(parse_completion, {"suffix": " the end"}).param == "suffix"
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "f", "arguments": "{}"}}]}
    err = _refused(parse_chat, {"messages": [*MSGS, call]})
    assert err.param == "messages.[1].tool_calls"


@pytest.mark.parametrize("parse", [parse_chat, parse_completion])
def test_harmless_parameters_are_accepted(parse: Any) -> None:
    body: dict[str, Any] = {
        "model": "tiny", "user": "u-1", "seed": 7, "stream_options": {"include_usage": True},
        "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "logprobs": False,
        "top_logprobs": 0, "response_format": {"type": "text"}, "n": 1, "echo": False,
        "tools": None, "tool_choice": None,
    }
    body.update({"messages": MSGS} if parse is parse_chat else {"prompt": "x"})
    req = parse(body, MODELS)
    assert req.user == "u-1" and req.seed == 7
    assert not req.stream and not req.include_usage  # stream_options: only when streaming


def test_defaults_and_max_completion_tokens_alias() -> None:
    chat = parse_chat({"model": "tiny", "messages": MSGS}, MODELS)
    assert (chat.max_tokens, chat.temperature) == (DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE)
    assert parse_chat({"model": "tiny", "messages": MSGS, "max_tokens": 5},
                      MODELS).max_tokens == 5
    both = {"model": "tiny", "messages": MSGS, "max_tokens": 5, "max_completion_tokens": 9}
    assert parse_chat(both, MODELS).max_tokens == 9
    # the error names the parameter the client actually sent
    assert _refused(parse_chat, {"max_tokens": 0}).param == "max_tokens"
    assert _refused(parse_chat, {"max_completion_tokens": 0}).param == "max_completion_tokens"


def test_tool_messages_are_accepted() -> None:
    msgs = [*MSGS, {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    req = parse_chat({"model": "tiny", "messages": msgs}, MODELS)
    assert req.messages[1] == {"role": "tool", "content": "42"}
