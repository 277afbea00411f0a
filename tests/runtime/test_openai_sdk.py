"""The official ``openai`` SDK against a real node (uvicorn on 127.0.0.1, in this process):
retrieve a model, stop strings on both endpoints (streamed and not), unsupported parameters
raising ``BadRequestError``. The engine is the scripted stand-in of test_stop_strings.py (the
same ``TEXT`` whatever the prompt), so the expected text and token counts are known."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import openai
import pytest

from radixmesh.engine.testing import ScriptedEngine
from radixmesh.runtime.inprocess import serving_node
from radixmesh.runtime.openai_api import DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE

TOKEN_S = 0.005
MAX_TOKENS = 200
HEAD = "Sure: 42."
TEXT = HEAD + " And more text after it." * 20
MSGS: list[Any] = [{"role": "user", "content": "What is it?"}]


@contextlib.asynccontextmanager
async def _client(engine: Any, extended: bool = True
                  ) -> AsyncIterator[tuple[openai.AsyncOpenAI, ScriptedEngine]]:
    """A node whose engine is the stand-in (``TEXT``, ``TOKEN_S`` apart), and an SDK client."""
    scripted = ScriptedEngine(engine, TEXT, TOKEN_S)
    # The scripted stand-in ignores penalties and logprobs (so it says it has none); tests
    # that only check the API accepts them declare it extended.
    scripted.extended_sampling = extended  # type: ignore[misc]
    async with serving_node(scripted, "sdk") as (_, address):
        client = openai.AsyncOpenAI(base_url=f"http://{address}/v1", api_key="unused",
                                    max_retries=0, timeout=30)
        try:
            yield client, scripted
        finally:
            await client.close()


def _run(
    engine: Any, body: Callable[[openai.AsyncOpenAI, ScriptedEngine], Awaitable[None]],
    extended: bool = True,
) -> None:
    async def scenario() -> None:
        async with _client(engine, extended) as (client, scripted):
            await body(client, scripted)

    asyncio.run(scenario())


def test_models_retrieve_and_list(engine: Any) -> None:
    async def body(client: openai.AsyncOpenAI, _: ScriptedEngine) -> None:
        model = await client.models.retrieve("micro")
        assert (model.id, model.object, model.owned_by) == ("micro", "model", "radixmesh")
        extra = (model.model_extra or {})["radixmesh"]
        assert extra["default_max_tokens"] == DEFAULT_MAX_TOKENS
        assert extra["default_temperature"] == DEFAULT_TEMPERATURE
        listed = [m.id async for m in client.models.list()]
        assert listed == ["micro"]
        with pytest.raises(openai.NotFoundError) as info:
            await client.models.retrieve("gpt-9")
        assert info.value.code == "model_not_found" and info.value.param == "model"

    _run(engine, body)


def test_chat_with_stop(engine: Any) -> None:
    async def body(client: openai.AsyncOpenAI, scripted: ScriptedEngine) -> None:
        chat = await client.chat.completions.create(
            model="micro", messages=MSGS, max_completion_tokens=MAX_TOKENS, stop=["42"],
            user="tester", seed=1)
        choice = chat.choices[0]
        assert (choice.message.content, choice.finish_reason) == ("Sure: ", "stop")
        assert chat.usage is not None and chat.usage.completion_tokens == len("Sure: 42")
        assert scripted.generated < MAX_TOKENS // 3  # the engine stopped there
        tool: Any = [*MSGS, {"role": "assistant", "content": "Let me look."},
                     {"role": "tool", "tool_call_id": "c1", "content": "42"}]
        answer = await client.chat.completions.create(model="micro", messages=tool,
                                                      max_tokens=3)
        assert answer.choices[0].message.content == TEXT[:3]  # the template renders "tool"

    _run(engine, body)


def test_completion_with_stop_not_streamed_and_streamed(engine: Any) -> None:
    async def body(client: openai.AsyncOpenAI, scripted: ScriptedEngine) -> None:
        done = await client.completions.create(model="micro", prompt="Go.", stop=".",
                                               max_tokens=MAX_TOKENS)
        assert (done.choices[0].text, done.choices[0].finish_reason) == ("Sure: 42", "stop")
        assert done.usage is not None and done.usage.completion_tokens == len(HEAD)
        stream = await client.completions.create(
            model="micro", prompt="Go.", stop=["And"], max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        assert (text, finish) == (HEAD + " ", "stop")
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == len(HEAD + " And")
        assert scripted.generated < 2 * MAX_TOKENS // 3  # both requests were stopped

    _run(engine, body)


def test_unsupported_parameters_raise_bad_request(engine: Any) -> None:
    tool: Any = {"type": "function", "function": {"name": "f", "parameters": {}}}
    refused: list[tuple[str, dict[str, Any]]] = [
        ("tools", {"tools": [tool]}),
        ("tool_choice", {"tool_choice": "auto"}),
        ("response_format", {"response_format": {"type": "json_object"}}),
        ("logit_bias", {"logit_bias": {"1": 5}}),
        # the scripted stand-in has no extended_sampling: refused, never ignored
        ("logprobs", {"logprobs": True}),
        ("presence_penalty", {"presence_penalty": 0.5}),
        ("frequency_penalty", {"frequency_penalty": -0.5}),
    ]

    async def body(client: openai.AsyncOpenAI, scripted: ScriptedEngine) -> None:
        for param, kwargs in refused:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="micro", messages=MSGS,
                                                     max_tokens=2, **kwargs)
            assert info.value.param == param and info.value.code == "unsupported_value"
            assert param in info.value.message
        for param, kwargs in [("suffix", {"suffix": "end"}), ("best_of", {"best_of": 3}),
                              ("logprobs", {"logprobs": 2})]:
            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model="micro", prompt="x", **kwargs)
            assert info.value.param == param and info.value.code == "unsupported_value"
        with pytest.raises(openai.BadRequestError) as info:  # a schema error: 400, not 422
            await client.completions.create(model="micro", prompt="x", max_tokens="8")  # type: ignore[arg-type]
        assert info.value.param == "max_tokens" and info.value.status_code == 400
        assert scripted.generated == 0  # nothing reached the engine

    _run(engine, body, extended=False)
