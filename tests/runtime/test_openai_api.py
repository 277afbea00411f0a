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
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"frequency_penalty": "high"}, "frequency_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"user": 5}, "user"),
    ],
)
def test_unsupported_parameters_are_a_400_naming_them(parse: Any, extra: dict[str, Any],
                                                      param: str) -> None:
    err = _refused(parse, extra)
    assert err.param == param
    assert param in err.message


@pytest.mark.parametrize(
    ("parse", "extra", "param"),
    [
        (parse_completion, {"logprobs": True}, "logprobs"),  # completions: an int
        (parse_completion, {"logprobs": 21}, "logprobs"),
        (parse_completion, {"best_of": 3}, "best_of"),
        (parse_completion, {"max_tokens": 0}, "max_tokens"),  # 0 only to score (echo)
        (parse_completion, {"max_tokens": 0, "echo": True}, "max_tokens"),
        (parse_completion, {"prompt": []}, "prompt"),
        (parse_completion, {"prompt": [[]]}, "prompt"),
        (parse_completion, {"prompt": ["a", 1]}, "prompt"),
        (parse_completion, {"prompt": ["x"] * 65}, "prompt"),
        (parse_completion, {"prompt": ["x"] * 16, "n": 16}, "prompt"),  # > 128 choices
        (parse_chat, {"logprobs": 1}, "logprobs"),  # chat: a boolean
        (parse_chat, {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        (parse_chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (parse_chat, {"echo": True}, "echo"),
    ],
)
def test_new_parameters_refuse_what_openai_refuses(parse: Any, extra: dict[str, Any],
                                                   param: str) -> None:
    assert _refused(parse, extra).param == param


def test_new_parameters_are_parsed() -> None:
    req = parse_completion({"model": "tiny", "prompt": ["a", "b"], "n": 3, "echo": True,
                            "logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": -1,
                            "best_of": 3, "seed": 9}, MODELS)
    assert req.prompts == ("a", "b") and req.n == 3 and req.echo and req.logprobs == 2
    first, third = req.sampling(sample=0), req.sampling(sample=2)
    assert (first.seed, third.seed) == (9, 11)  # sample j: seed + j
    assert first.prompt_logprobs == 2 and third.prompt_logprobs is None  # scored once
    assert (first.presence_penalty, first.frequency_penalty) == (0.5, -1.0)
    ids = parse_completion({"model": "tiny", "prompt": [[1, 2], [3]]}, MODELS)
    assert ids.prompts == ((1, 2), (3,))
    score = parse_completion({"model": "tiny", "prompt": "x", "max_tokens": 0, "echo": True,
                              "logprobs": 0}, MODELS)
    assert score.max_tokens == 0 and score.sampling().prompt_logprobs == 0
    chat = parse_chat({"model": "tiny", "messages": MSGS, "logprobs": True,
                       "top_logprobs": 4, "n": 2}, MODELS)
    assert chat.logprobs == 4 and chat.n == 2 and chat.sampling().prompt_logprobs is None
    assert parse_chat({"model": "tiny", "messages": MSGS, "logprobs": True},
                      MODELS).logprobs == 0
    assert parse_chat({"model": "tiny", "messages": MSGS, "logprobs": False,
                       "top_logprobs": 0}, MODELS).logprobs is None


def test_schema_errors_name_the_parameter_as_openai_does() -> None:
    bad_role = [{"role": "robot", "content": "x"}]
    err = _refused(parse_chat, {"messages": [*MSGS, *bad_role]})
    assert err.param == "messages.[1].role" and err.code == "invalid_value"
    err = _refused(parse_chat, {"messages": [{"role": "user", "content": 5}]})
    assert err.param == "messages.[0].content" and err.code == "invalid_type"
    assert "a string or an array of text parts" in err.message
    err = _refused(parse_completion, {"prompt": 5})
    assert err.param == "prompt" and "token ids" in err.message
    with pytest.raises(ApiError) as info:
        parse_completion({"prompt": "x"}, MODELS)
    assert info.value.param == "model" and info.value.code == "missing"


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
    assert DEFAULT_TEMPERATURE == 1.0  # OpenAI's default
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
