"""The emulated engine's HTTP surface as vLLM 0.32 shapes it and as the node's HttpEngine
(``--engine vllm``) reads it: token-id prompts, SSE chunks with ``token_id:N`` logprob tokens,
the finish reason on the last token's chunk, a usage chunk with cached tokens, ``[DONE]``;
text and batch prompts, chat, stop tokens; malformed requests are 400s in vLLM's error shape,
counted, and the server keeps serving; models / health / metrics say "emulated"."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest

from radixmesh.emulate.fake import FakeEngine, next_token, running

if TYPE_CHECKING:
    from conftest import Poll


def expected(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


Scenario = Callable[[FakeEngine, aiohttp.ClientSession], Awaitable[None]]


def with_engine(scenario: Scenario, **kwargs: Any) -> None:
    async def main() -> None:
        async with running(**kwargs) as fake, aiohttp.ClientSession() as http:
            await scenario(fake, http)

    asyncio.run(main())


async def sse(resp: aiohttp.ClientResponse) -> list[Any]:
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_a_streamed_token_id_completion_has_vllms_shape() -> None:
    async def scenario(fake: FakeEngine, http: aiohttp.ClientSession) -> None:
        prompt = list(b"the emulated engine streams token ids back")
        body = {"model": fake.model, "prompt": prompt, "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}, "logprobs": 1,
                "return_tokens_as_token_ids": True}
        async with http.post(fake.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = await sse(resp)
        assert events[-1] == "[DONE]"
        usage_chunk, token_chunks = events[-2], events[:-2]
        assert len(token_chunks) == 5 and all(
            e["object"] == "text_completion" and e["model"] == fake.model for e in token_chunks)
        ids = [int(e["choices"][0]["logprobs"]["tokens"][0].split(":")[1]) for e in token_chunks]
        assert ids == expected(prompt, 5)
        assert "".join(e["choices"][0]["text"] for e in token_chunks) == bytes(ids).decode()
        assert [e["choices"][0]["finish_reason"] for e in token_chunks] == [None] * 4 + ["length"]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 5,
                                        "total_tokens": len(prompt) + 5,
                                        "prompt_tokens_details": {"cached_tokens": 0}}

    with_engine(scenario)


def test_text_batch_and_stop_tokens_without_streaming() -> None:
    async def scenario(fake: FakeEngine, http: aiohttp.ClientSession) -> None:
        texts = ["first prompt of a batch", "second prompt of the batch"]
        body = {"model": fake.model, "prompt": texts, "max_tokens": 6}
        async with http.post(fake.url + "/v1/completions", json=body) as resp:
            out = await resp.json()
        assert resp.status == 200 and out["object"] == "text_completion"
        assert [c["index"] for c in out["choices"]] == [0, 1]
        for text, choice in zip(texts, out["choices"], strict=True):
            assert choice["text"] == bytes(expected(list(text.encode()), 6)).decode()
            assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
        assert out["usage"]["prompt_tokens"] == sum(map(len, texts))
        assert out["usage"]["completion_tokens"] == 12
        prompt = list(b"stop at the third token")
        third = expected(prompt, 3)[2]
        body = {"prompt": prompt, "max_tokens": 50, "stop_token_ids": [third]}
        async with http.post(fake.url + "/v1/completions", json=body) as resp:
            out = await resp.json()
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == third
        assert out["usage"]["completion_tokens"] == 3

    with_engine(scenario)


def test_chat_completions_stream_and_whole() -> None:
    async def scenario(fake: FakeEngine, http: aiohttp.ClientSession) -> None:
        messages = [{"role": "user", "content": "hello, emulated engine"}]
        body = {"model": fake.model, "messages": messages, "max_tokens": 4}
        async with http.post(fake.url + "/v1/chat/completions", json=body) as resp:
            whole = await resp.json()
        assert whole["object"] == "chat.completion"
        message = whole["choices"][0]["message"]
        assert message["role"] == "assistant" and len(message["content"]) == 4
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        async with http.post(fake.url + "/v1/chat/completions", json=body) as resp:
            events = await sse(resp)
        chunks = events[:-2]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == message["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["usage"]["completion_tokens"] == 4

    with_engine(scenario)


@pytest.mark.parametrize(("body", "param"), [
    (b"{not json", None),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": [1, 2, 2**32]}, "prompt"),
    ({"prompt": [[1, 2], "ok", 7]}, "prompt"),
    ({"prompt": "x", "stop_token_ids": "1"}, "stop_token_ids"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x" * 100, "max_tokens": 500}, "max_tokens"),  # past the 512-token context
    ([1, 2, 3], None),
    (b'{"prompt": "\\ud800"}', "prompt"),  # a lone surrogate: no UTF-8 text (a 500 before)
    (b'{"prompt": ["ok", "\\udfff"]}', "prompt"),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),  # too deep for the parser
])
def test_malformed_requests_are_400s_in_vllms_shape_and_counted(body: Any,
                                                                 param: str | None) -> None:
    async def scenario(fake: FakeEngine, http: aiohttp.ClientSession) -> None:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with http.post(fake.url + "/v1/completions", **kwargs) as resp:
            out = await resp.json()
        assert resp.status == 400
        assert out["error"]["type"] == "BadRequestError" and out["error"]["code"] == 400
        assert out["error"]["param"] == param and out["error"]["message"]
        assert fake.bad_requests == 1 and fake.active == 0
        async with http.post(fake.url + "/v1/completions",
                             json={"prompt": "still serving", "max_tokens": 2}) as resp:
            assert resp.status == 200  # and the engine goes on

    with_engine(scenario)


def test_a_bad_chat_body_is_a_400_and_another_model_a_404() -> None:
    async def scenario(fake: FakeEngine, http: aiohttp.ClientSession) -> None:
        async with http.post(fake.url + "/v1/completions",
                             json={"model": "other", "prompt": "x"}) as resp:
            out = await resp.json()
        assert resp.status == 404 and out["error"]["type"] == "NotFoundError"
        async with http.post(fake.url + "/v1/chat/completions",
                             json={"messages": [{"role": "user"}]}) as resp:
            out = await resp.json()
        assert resp.status == 400 and out["error"]["param"] == "messages"
        for bad in ({"content": "hi"}, {"role": "wizard", "content": "hi"},
                    {"role": "user", "content": "\ud800"}):  # each a 500 before
            async with http.post(fake.url + "/v1/chat/completions",
                                 json={"messages": [bad]}) as resp:
                out = await resp.json()
            assert resp.status == 400 and out["error"]["param"] == "messages", bad
        for method, path, status in (("GET", "/v1/completions", 405),
                                     ("POST", "/v1/nowhere", 404)):
            async with http.request(method, fake.url + path) as resp:
                out = await resp.json()  # JSON, as vLLM's FastAPI answers, not plain text
            assert resp.status == status and out["error"]["code"] == status

    with_engine(scenario)


def test_models_health_version_and_metrics_say_emulated() -> None:
    async def scenario(fake: FakeEngine, http: aiohttp.ClientSession) -> None:
        async with http.get(fake.url + "/v1/models") as resp:
            card = (await resp.json())["data"][0]
        assert card["id"] == fake.model and card["emulated"] is True
        assert card["profile"] == "fake" and card["max_model_len"] == 512
        async with http.get(fake.url + "/health") as resp:
            assert resp.status == 200 and (await resp.json())["emulated"] is True
        async with http.get(fake.url + "/version") as resp:
            version = await resp.json()
        assert version["version"] == "0.32.0" and version["emulated"] is True
        async with http.post(fake.url + "/v1/completions",
                             json={"prompt": "count me", "max_tokens": 3}) as resp:
            assert resp.status == 200
        async with http.get(fake.url + "/metrics") as resp:
            text = await resp.text()
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                  for line in text.splitlines() if line and not line.startswith("#")}
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "emulator_busy_seconds_total",
                     "emulator_lag_seconds_total"):
            assert name in values
        assert values["vllm:prefix_cache_queries_total"] == len(b"count me")
        assert values["vllm:generation_tokens_total"] == 3
        assert values["emulator_info"] == 1
        assert 'profile="fake"' in text and 'emulated="true"' in text

    with_engine(scenario)


def test_a_client_that_goes_away_aborts_its_sequence_in_the_scheduler(poll: Poll) -> None:
    async def scenario(fake: FakeEngine, http: aiohttp.ClientSession) -> None:
        fake.faults.token_delay_s = 0.01  # steps last long enough to leave mid-stream
        body = {"prompt": "a long generation", "max_tokens": 400, "stream": True}
        resp = await http.post(fake.url + "/v1/completions", json=body)
        chunks = 0
        async for line in resp.content:
            chunks += line.startswith(b"data: ")
            if chunks == 3:
                break
        resp.close()  # the client goes away
        sched = fake.loop.scheduler

        def gone() -> bool:
            return fake.loop.counters.aborted == 1 and sched.running == sched.waiting == 0

        await poll.until_async(gone, "the sequence to be aborted", 10.0)
        assert fake.disconnects == 1 and fake.active == 0
        assert fake.loop.counters.generation_tokens < 400

    with_engine(scenario)


def test_a_failing_step_aborts_what_is_in_flight_and_the_engine_goes_on() -> None:
    async def scenario(fake: FakeEngine, http: aiohttp.ClientSession) -> None:
        broken = fake.loop.scheduler

        def boom(now: float) -> None:
            raise RuntimeError("a scheduler bug")

        broken.schedule = boom  # type: ignore[method-assign]
        async with http.post(fake.url + "/v1/completions",
                             json={"prompt": "hit the bug", "max_tokens": 4}) as resp:
            out = await resp.json()
        assert resp.status == 200 and out["choices"][0]["finish_reason"] == "abort"
        assert fake.loop.scheduler is not broken and fake.active == 0
        async with http.post(fake.url + "/v1/completions",
                             json={"prompt": "and after it", "max_tokens": 4}) as resp:
            out = await resp.json()
        assert out["choices"][0]["finish_reason"] == "length"

    with_engine(scenario)
