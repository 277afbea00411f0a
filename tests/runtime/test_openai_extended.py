"""The OpenAI parameters beyond plain sampling, through the official ``openai`` SDK against a
real node on the built-in engine (the ``tiny`` preset; uvicorn on 127.0.0.1 in a thread):
``logprobs`` (+ ``echo``: the prompt's, equal to log_softmax of a full forward pass — what
lm-evaluation-harness reads), chat ``logprobs`` / ``top_logprobs``, ``n`` with a seed,
batched prompts, penalties, ``max_tokens: 0``, ``max_completion_tokens``, ``user``; each one
streamed and not. The generated OpenAPI document and the 400 / 413 bodies too."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from radixmesh.engine.base import GenerateRequest, SamplingParams
from radixmesh.engine.factory import build_engine
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.inprocess import ServedInThread, free_port, serving
from radixmesh.runtime.node import NodeService

MODEL = "tiny"
PROMPT = "Question: which animal is quick and brown?\nAnswer:"
CHAT = [{"role": "user", "content": "Name a quick brown animal."}]


class _Node(ServedInThread):
    """A node served on its own event loop thread for the whole module."""

    def __init__(self) -> None:
        self.engine = build_engine(MODEL, cache_tokens=16384, threads=1)
        port = free_port()
        super().__init__(NodeService(ServeConfig(node_id="ext", port=port, gossip_interval=5.0,
                                                 max_body_bytes=200_000), self.engine),
                         port, start_timeout_s=120)


@pytest.fixture(scope="module")
def node() -> Iterator[_Node]:
    n = _Node()
    yield n
    n.close()


@pytest.fixture(scope="module")
def client(node: _Node) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def _full_logprobs(engine: Any, ids: list[int]) -> torch.Tensor:
    """Reference: log_softmax of every position of one uncached forward pass."""
    with torch.inference_mode():
        x = torch.tensor([ids], dtype=torch.long)
        logits = engine.model(input_ids=x).logits[0, :, : engine._allowed].float()
    return torch.log_softmax(logits, dim=-1)


def _stream_texts(chunks: list[Any], chat: bool = False) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
    return texts


# ----------------------------------------------------------------------------- logprobs
def test_echo_logprobs_equal_a_full_forward_pass_as_lm_eval_reads_them(
        node: _Node, client: openai.OpenAI) -> None:
    tok = node.engine.tokenizer
    context, continuation = tok.encode(PROMPT), tok.encode(" a fox")
    ids = context + continuation
    client.completions.create(model=MODEL, prompt=[context[:-3]], max_tokens=2,
                              temperature=0)  # part of the prompt is cached now
    assert node.engine.match(ids) > 0
    # lm-eval's local-completions loglikelihood request, exactly
    out = client.completions.create(model=MODEL, prompt=[ids], temperature=0, max_tokens=1,
                                    logprobs=1, seed=1234, echo=True)
    (choice,) = out.choices
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.tokens is not None and lp.text_offset is not None
    assert len(lp.token_logprobs) == len(ids) + 1  # the prompt, then the generated token
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _full_logprobs(node.engine, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        (best,) = lp.top_logprobs[i].values()
        assert best == pytest.approx(ref[i - 1].max().item(), abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert choice.text.startswith(tok.decode(ids))
    # lm-eval's parse_logprobs: sum(token_logprobs[ctxlen:-1]) and is_greedy
    ctxlen = len(context)
    score = sum(lp.token_logprobs[ctxlen:-1])
    expected = sum(ref[i - 1, ids[i]].item() for i in range(ctxlen, len(ids)))
    assert score == pytest.approx(expected, abs=1e-3)
    greedy = all(t == max(top.values()) for t, top in
                 zip(lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1], strict=True))
    ref_greedy = all(int(ref[i - 1].argmax()) == ids[i] for i in range(ctxlen, len(ids)))
    assert greedy == ref_greedy
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # scoring computes it all


def test_max_tokens_zero_scores_the_prompt_and_batches_are_indexed(
        node: _Node, client: openai.OpenAI) -> None:
    tok = node.engine.tokenizer
    prompts = [tok.encode(PROMPT), tok.encode("Another prompt entirely.")]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=0, echo=True,
                                    logprobs=0)
    assert [c.index for c in out.choices] == [0, 1]
    for choice, ids in zip(out.choices, prompts, strict=True):
        assert choice.text == tok.decode(ids) and choice.logprobs is not None
        assert choice.logprobs.tokens is not None and len(choice.logprobs.tokens) == len(ids)
        assert choice.logprobs.top_logprobs is not None
        assert all(t == {} for t in choice.logprobs.top_logprobs[1:])  # 0 alternatives
    assert out.usage is not None and out.usage.completion_tokens == 0
    assert out.usage.prompt_tokens == sum(map(len, prompts))


def test_completion_logprobs_streamed_equal_not_streamed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6,
                              "temperature": 0, "logprobs": 2, "echo": True}
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert whole.logprobs is not None
    tokens: list[str] = []
    values: list[float | None] = []
    offsets: list[int] = []
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            lp = c.choices[0].logprobs
            tokens += lp.tokens or []
            values += lp.token_logprobs or []
            offsets += lp.text_offset or []
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    assert values == pytest.approx(whole.logprobs.token_logprobs)


def test_chat_logprobs_and_top_logprobs(node: _Node, client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": CHAT, "temperature": 0,
                              "max_completion_tokens": 5, "logprobs": True,
                              "top_logprobs": 3, "user": "someone"}
    answer = client.chat.completions.create(**kwargs)
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert answer.usage is not None and len(content) == answer.usage.completion_tokens
    prompt = node.engine.tokenizer.apply_chat_template(CHAT)
    out = node.engine.generate(GenerateRequest("ref", tuple(prompt), SamplingParams(
        max_tokens=5))).output_ids  # greedy: the same tokens
    assert [node.engine.tokenizer.decode([t]) for t in out] == [i.token for i in content]
    ref = _full_logprobs(node.engine, list(prompt) + out)
    for j, item in enumerate(content):
        row = ref[len(prompt) - 1 + j]
        assert item.logprob == pytest.approx(row[out[j]].item(), abs=1e-4)
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob == pytest.approx(
            row.max().item(), abs=1e-4)
        assert item.bytes == list(item.token.encode())
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = [i for c in chunks if c.choices and c.choices[0].logprobs
                for i in (c.choices[0].logprobs.content or [])]
    assert [i.token for i in streamed] == [i.token for i in content]
    assert _stream_texts(chunks, chat=True)[0] == choice.message.content


# ----------------------------------------------------------------------------- n, batches
def test_n_with_a_seed_is_reproducible_and_later_samples_reuse_the_prompt(
        node: _Node, client: openai.OpenAI) -> None:
    prompt = "A fresh prompt for sampling, never sent before: " + "xyz " * 20
    n_prompt = len(node.engine.tokenizer.encode(prompt))
    before = node.service.metrics.cached_tokens
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": prompt, "n": 3, "seed": 5,
                              "temperature": 1.0, "max_tokens": 8}
    first = client.completions.create(**kwargs)
    reused = node.service.metrics.cached_tokens - before
    assert reused >= 2 * (n_prompt - node.engine.spec.block_size)  # samples 2, 3 reused it
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert len(set(texts)) > 1  # seed + j: different samples
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == texts  # the same seed, the same samples
    streamed = _stream_texts(list(client.completions.create(stream=True, **kwargs)))
    assert [streamed[i] for i in range(3)] == texts
    assert first.usage is not None and first.usage.prompt_tokens == n_prompt  # counted once
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, seed=3,
                                          max_tokens=4)
    assert [c.index for c in chat.choices] == [0, 1]


def test_batched_prompts_equal_one_request_each(client: openai.OpenAI) -> None:
    prompts = ["First prompt here.", "Second, a different one.", "Third."]
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "temperature": 0, "n": 2}
    batch = client.completions.create(prompt=prompts, **kwargs)
    assert [c.index for c in batch.choices] == list(range(6))  # prompt * n + sample
    for p, prompt in enumerate(prompts):
        alone = client.completions.create(prompt=prompt, **kwargs)
        assert [c.text for c in alone.choices] == [batch.choices[2 * p + j].text
                                                   for j in range(2)]
    streamed = _stream_texts(list(client.completions.create(prompt=prompts, stream=True,
                                                            **kwargs)))
    assert [streamed[i] for i in range(6)] == [c.text for c in batch.choices]
    echo = client.completions.create(prompt=prompts, echo=True, **kwargs)
    assert all(c.text.startswith(prompts[c.index // 2]) for c in echo.choices)


# ----------------------------------------------------------------------------- penalties
@pytest.mark.parametrize("stream", [False, True])
def test_penalties_change_the_answer_as_the_engine_computes_them(
        node: _Node, client: openai.OpenAI, stream: bool) -> None:
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 1.0}
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12,
                              "temperature": 0, **penalties}
    if stream:
        text = _stream_texts(list(client.completions.create(stream=True, **kwargs)))[0]
    else:
        text = client.completions.create(**kwargs).choices[0].text
    ids = node.engine.tokenizer.encode(PROMPT)
    # the engine's own answer for the same parameters (tests/engine: exact vs a reference)
    ref = node.engine.generate(GenerateRequest(
        "ref", tuple(ids), SamplingParams(max_tokens=12, **penalties)))
    assert text == node.engine.tokenizer.decode(ref.output_ids)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                      temperature=0).choices[0].text
    assert plain != text


# ----------------------------------------------------------------------------- schema
def test_openapi_is_generated_from_the_models(node: _Node) -> None:
    doc = httpx.get(node.url + "/openapi.json").json()
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                 "/v1/models/{model_id}", "/health", "/mesh", "/metrics"}
    schemas = doc["components"]["schemas"]
    props = schemas["CompletionRequest"]["properties"]
    assert {"prompt", "n", "logprobs", "echo", "presence_penalty", "best_of"} <= set(props)
    assert props["model"]["enum"] == [MODEL]  # the served model, from the request model
    assert {"logprobs", "top_logprobs", "max_completion_tokens"} <= set(
        schemas["ChatRequest"]["properties"])
    assert "HTTPValidationError" not in schemas
    for operations in doc["paths"].values():
        for operation in operations.values():
            assert "422" not in operation["responses"]
    models = httpx.get(node.url + "/v1/models").json()["data"][0]["radixmesh"]
    assert models["default_temperature"] == 1.0 and models["max_n"] >= 2


@pytest.mark.parametrize(
    ("content", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": "8"}', 400, "max_tokens"),
        (b'{"model": "tiny", "prompt": "x", "n": 99}', 400, "n"),
        (b'{"model": "tiny", "prompt": "x", "tools": []}', 400, "tools"),
        (b'{"model": "tiny", "prompt": "' + b"x" * 300_000 + b'"}', 413, None),
        (b"[" * 50_000, 400, None),  # nesting too deep for the parser
        (b"", 400, None),
        # JSON escapes that decode to lone surrogates: no UTF-8 text (a 500 before)
        (b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}', 400, "prompt"),
        (b'{"model": "tiny", "prompt": ["ok", "\\udfff"], "max_tokens": 2}', 400, "prompt"),
        (b'{"model": "\\ud800", "prompt": "x", "max_tokens": 2}', 404, "model"),
    ],
)
def test_bad_bodies_are_openai_errors(node: _Node, content: bytes, status: int,
                                      param: str | None) -> None:
    r = httpx.post(node.url + "/v1/completions", content=content,
                   headers={"content-type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


def test_a_lone_surrogate_in_a_chat_message_is_a_400(node: _Node) -> None:
    content = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'
    r = httpx.post(node.url + "/v1/chat/completions", content=content,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    ok = httpx.post(node.url + "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                        "max_tokens": 1})
    assert ok.status_code == 200  # and the node goes on


# ----------------------------------------------------------------------------- a mesh
def test_in_a_mesh_samples_follow_the_first_and_scoring_stays_local(node: _Node) -> None:
    """n samples of a forwarded prompt all run on the peer that took the first (reusing its
    cached prompt) and equal one node's answer; log-probabilities (which the forward
    protocol does not carry) run on the entry node."""
    prompt = "Mesh prompt, sampled three times: " + "abc " * 20
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": prompt, "n": 3, "seed": 11,
                              "temperature": 1.0, "max_tokens": 6}
    alone = openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0)
    single = [c.text for c in alone.completions.create(**kwargs).choices]

    async def scenario() -> None:
        peer_engine = build_engine(MODEL, cache_tokens=16384, threads=1)
        entry_engine = build_engine(MODEL, cache_tokens=16384, threads=1)
        pp, ep = free_port(), free_port()
        peer = NodeService(ServeConfig(node_id="peer", port=pp, gossip_interval=5.0),
                           peer_engine)
        entry = NodeService(ServeConfig(node_id="entry", port=ep, gossip_interval=5.0),
                            entry_engine)
        async with serving(peer, pp) as peer_address, serving(entry, ep) as address:
            entry.core.peer_address = (  # type: ignore[method-assign]
                lambda peer_id: peer_address if peer_id == "peer" else None)
            client = openai.AsyncOpenAI(base_url=f"http://{address}/v1", api_key="x",
                                        max_retries=0, timeout=60,
                                        default_headers={"x-radixmesh-target": "peer"})
            try:
                out = await client.completions.create(**kwargs)
                assert [c.text for c in out.choices] == single  # routing changes nothing
                assert entry.metrics.requests["forwarded"] == 3
                assert peer.metrics.served_for_peers == 3
                n_prompt = len(peer_engine.tokenizer.encode(prompt))
                assert peer.metrics.cached_tokens >= 2 * (n_prompt
                                                          - peer_engine.spec.block_size)
                scored = await client.completions.create(model=MODEL, prompt=prompt,
                                                         max_tokens=1, echo=True, logprobs=1,
                                                         temperature=0)
                assert scored.choices[0].logprobs is not None
                assert entry.metrics.requests["local"] == 1  # not forwarded
                assert peer.metrics.served_for_peers == 3
            finally:
                await client.close()
        alone.close()

    asyncio.run(scenario())


def test_a_json_body_is_json_whatever_its_content_type(node: _Node) -> None:
    """``curl -d`` sends application/x-www-form-urlencoded: the body is still JSON."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    r = httpx.post(node.url + "/v1/completions", headers=form,
                   content=b'{"model": "tiny", "prompt": "x", "max_tokens": 2}')
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
