"""The request shapes real clients send, replayed against a real node, and the responses read
the way those clients read them — without the clients installed (``make clients-check`` runs
the clients themselves).

Facts taken from the clients' source (lm-evaluation-harness 0.4.13
``lm_eval/models/openai_completions.py`` + ``api_models.py``; guidellm 0.8.1's
``openai_http`` backend as seen in its saved request arguments), restated here:

* ``local-completions``, generate-until, ``tokenizer_backend=None``: POST /v1/completions
  ``{"prompt": <str>, "model", "max_tokens", "temperature", "stop": [...], "seed": 1234}``
  (batch size 1: the prompt is one string); answers are ``choices`` by ``index`` → ``text``.
* ``local-completions``, loglikelihood, HF tokenizer of the model directory: the prompt is a
  list of token-id lists (``context + continuation``, one per batch entry) with
  ``{"temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": true, "seed": 1234}``; per
  choice, sorted by ``index``: ``sum(logprobs.token_logprobs[ctxlen:-1])`` and
  ``is_greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs[ctxlen:-1],
  top_logprobs[ctxlen:-1]))``. So the node must echo exactly the ids it got, one entry per
  prompt token plus the generated one.
* ``local-chat-completions`` with ``--apply_chat_template``: ``{"messages": [system
  (description), user/assistant few-shot turns..., user], "model", "max_tokens",
  "temperature", "stop": stop[:4], "seed"}``; answers are ``choices[i].message.content``.
* guidellm: ``GET /health``, ``GET /v1/models``, then streamed
  ``{"model", "stream": true, "stream_options": {"include_usage": true,
  "continuous_usage_stats": true}, "max_tokens", "ignore_eos": true, "prompt"}``.
* lm-eval's requests carry ``Authorization: Bearer `` (its empty key), which a node without
  ``--api-key`` ignores.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from operator import itemgetter
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixmesh.engine.factory import build_engine
from radixmesh.engine.testing import save_random_model_dir
from radixmesh.runtime.config import ServeConfig
from radixmesh.runtime.inprocess import ServedInThread, free_port
from radixmesh.runtime.node import NodeService

# lm-eval sends "Bearer " + its empty key; a server's HTTP parser strips the trailing space
# (and h11, under httpx, refuses to send it), so this is what the node sees
HEADERS = {"Authorization": "Bearer"}
SEED = 1234
CONTEXT = ("The following are multiple choice questions (with answers) about physics.\n\n"
           "Question: What is the unit of force?\nA. joule\nB. newton\nC. watt\nD. pascal\n"
           "Answer:")
CHOICES = (" A", " B", " C", " D")


class _Node(ServedInThread):
    """One node on the built-in engine over a saved model directory, on its own loop thread."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = build_engine(model_path=model_dir, cache_tokens=8192, threads=1)
        port = free_port()
        super().__init__(NodeService(ServeConfig(node_id="clients", port=port,
                                                 gossip_interval=5.0), self.engine), port)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_model_dir(tmp_path_factory.mktemp("clients") / "model", "micro")


@pytest.fixture(scope="module")
def node(model_dir: Path) -> Iterator[_Node]:
    n = _Node(model_dir)
    yield n
    n.close()


@pytest.fixture(scope="module")
def client(node: _Node) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=node.url, headers=HEADERS, timeout=60.0, trust_env=False) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path) -> Any:
    """What lm-eval loads for ``tokenizer=<model dir>``: ``AutoTokenizer.from_pretrained``."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def _ok(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 200, resp.text
    body: dict[str, Any] = resp.json()
    return body


# ------------------------------------------------------------------ the clients' parsers
def parse_generations(out: dict[str, Any]) -> list[str]:
    """lm-eval local-completions: texts by choice index."""
    texts: list[Any] = [None] * len(out["choices"])
    for choice in out["choices"]:
        texts[choice["index"]] = choice["text"]
    return texts


def parse_logprobs(out: dict[str, Any], ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval local-completions: (continuation log-likelihood, is greedy) per choice."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens,
                              strict=False):
        assert ctxlen > 0
        token_lp = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(t == max(alts.values()) for t, alts in zip(token_lp, top, strict=False))
        res.append((sum(token_lp), greedy))
    return res


def chat_generations(out: dict[str, Any]) -> list[str]:
    """lm-eval local-chat-completions: message contents by choice index."""
    texts: list[Any] = [None] * len(out["choices"])
    for choice in out["choices"]:
        texts[choice["index"]] = choice["message"]["content"]
    return texts


def loglik_payload(model: str, prompts: list[list[int]]) -> dict[str, Any]:
    return {"model": model, "prompt": prompts, "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": SEED, "echo": True}


def encode(tok: Any, text: str) -> list[int]:
    """lm-eval's tok_encode for huggingface: no special tokens (add_bos_token False)."""
    ids: list[int] = tok(text, add_special_tokens=False, truncation=False,
                         return_attention_mask=False).input_ids
    return ids


def encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's _encode_pair: the whole string encoded, the context's length split off."""
    whole = encode(tok, context + continuation)
    ctx = encode(tok, context)
    return whole[:len(ctx)], whole[len(ctx):]


# ------------------------------------------------------------------ lm-eval local-completions
def test_generate_until_text_prompt(client: httpx.Client, node: _Node) -> None:
    model = node.engine.model_name
    body = {"prompt": CONTEXT, "model": model, "max_tokens": 4, "temperature": 0.0,
            "stop": ["\n"], "seed": SEED}
    first = _ok(client.post("/v1/completions", json=body))
    texts = parse_generations(first)
    assert len(texts) == 1 and isinstance(texts[0], str) and "\n" not in texts[0]
    assert first["usage"]["completion_tokens"] <= 4
    again = parse_generations(_ok(client.post("/v1/completions", json=body)))
    assert again == texts  # greedy, the prefix now cached: the same answer


def _loglik(client: httpx.Client, model: str, tok: Any
            ) -> tuple[list[list[int]], list[int], list[tuple[float, bool]], dict[str, Any]]:
    pairs = [encode_pair(tok, CONTEXT, c) for c in CHOICES]
    inputs = [ctx + cont for ctx, cont in pairs]
    ctxlens = [len(ctx) for ctx, _ in pairs]
    results: list[tuple[float, bool]] = []
    last: dict[str, Any] = {}
    for inp, ctxlen in zip(inputs, ctxlens, strict=True):  # batch size 1: one per request
        last = _ok(client.post("/v1/completions", json=loglik_payload(model, [inp])))
        results += parse_logprobs(last, [ctxlen])
    return inputs, ctxlens, results, last


def test_loglikelihood_token_prompts(client: httpx.Client, node: _Node, hf_tokenizer: Any
                                     ) -> None:
    model = node.engine.model_name
    inputs, ctxlens, results, last = _loglik(client, model, hf_tokenizer)
    assert all(ctxlen > 0 for ctxlen in ctxlens)
    lp = last["choices"][0]["logprobs"]
    # one entry per prompt token (echoed exactly as sent) plus the generated token
    assert len(lp["token_logprobs"]) == len(inputs[-1]) + 1 == len(lp["top_logprobs"])
    assert lp["token_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0.0 for x in lp["token_logprobs"][1:])
    assert all(isinstance(t, dict) and t for t in lp["top_logprobs"][1:])
    echoed = hf_tokenizer.decode(inputs[-1])
    assert last["choices"][0]["text"].startswith(echoed)
    for score, greedy in results:
        assert math.isfinite(score) and score < 0.0 and isinstance(greedy, bool)
    # the context is cached now: scoring again (cache hits) gives the same log-likelihoods
    _, _, again, _ = _loglik(client, model, hf_tokenizer)
    for (a, ga), (b, gb) in zip(results, again, strict=True):
        assert abs(a - b) < 1e-4 and ga == gb


def test_loglikelihood_greedy_flag(client: httpx.Client, node: _Node, hf_tokenizer: Any
                                   ) -> None:
    """Score the model's own greedy next token: lm-eval compares floats exactly
    (``tok != max(top.values())``), so the echoed prompt position must carry the very value
    the generated position had, and the harness must call it greedy."""
    model = node.engine.model_name
    ctx = encode(hf_tokenizer, CONTEXT)
    gen = _ok(client.post("/v1/completions", json=loglik_payload(model, [ctx])))
    lp = gen["choices"][0]["logprobs"]
    value, top = lp["token_logprobs"][-1], lp["top_logprobs"][-1]
    assert value == max(top.values())  # generated greedily: it is the top-1, the same float
    token_id = _unique_id(hf_tokenizer, lp["tokens"][-1])
    if token_id is None:
        pytest.skip(f"greedy token {lp['tokens'][-1]!r} has no unique id to send back")
    out = _ok(client.post("/v1/completions", json=loglik_payload(model, [[*ctx, token_id]])))
    [(score, greedy)] = parse_logprobs(out, [len(ctx)])
    assert greedy, out["choices"][0]["logprobs"]["top_logprobs"][len(ctx)]
    assert abs(score - value) < 1e-4


def _unique_id(tok: Any, text: str) -> int | None:
    """The one token id whose text (the node's ``decode([id])``) is ``text``, if unique."""
    ids = [i for i in range(len(tok)) if tok.decode([i]) == text]
    return ids[0] if len(ids) == 1 and text and "\ufffd" not in text else None


def test_loglikelihood_batched_prompts(client: httpx.Client, node: _Node, hf_tokenizer: Any
                                       ) -> None:
    """batch_size=2: one request, two token-id prompts; choices by index, one per prompt."""
    model = node.engine.model_name
    pairs = [encode_pair(hf_tokenizer, CONTEXT, c) for c in CHOICES[:2]]
    inputs = [ctx + cont for ctx, cont in pairs]
    out = _ok(client.post("/v1/completions", json=loglik_payload(model, inputs)))
    assert sorted(c["index"] for c in out["choices"]) == [0, 1]
    for choice in out["choices"]:
        assert len(choice["logprobs"]["token_logprobs"]) == len(inputs[choice["index"]]) + 1
    batched = parse_logprobs(out, [len(ctx) for ctx, _ in pairs])
    single = [parse_logprobs(_ok(client.post("/v1/completions",
                                             json=loglik_payload(model, [inp]))), [len(ctx)])[0]
              for inp, (ctx, _) in zip(inputs, pairs, strict=True)]
    for (a, ga), (b, gb) in zip(batched, single, strict=True):
        assert abs(a - b) < 1e-4 and ga == gb


# ------------------------------------------------------------------ lm-eval local-chat
def test_chat_fewshot_multiturn(client: httpx.Client, node: _Node) -> None:
    messages = [
        {"role": "system", "content": "The following are multiple choice questions (with "
                                      "answers) about physics.\n\n"},
        {"role": "user", "content": "What is the unit of force?\nA. joule\nB. newton\n"
                                    "C. watt\nD. pascal\nAnswer:"},
        {"role": "assistant", "content": "B"},
        {"role": "user", "content": "What is the unit of power?\nA. joule\nB. newton\n"
                                    "C. watt\nD. pascal\nAnswer:"},
    ]
    body = {"messages": messages, "model": node.engine.model_name, "max_tokens": 4,
            "temperature": 0.0, "stop": ["\n"], "seed": SEED}
    out = _ok(client.post("/v1/chat/completions", json=body))
    texts = chat_generations(out)
    assert len(texts) == 1 and isinstance(texts[0], str) and "\n" not in texts[0]
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert chat_generations(_ok(client.post("/v1/chat/completions", json=body))) == texts


# ------------------------------------------------------------------ gateways (SMG)
def test_version_answers_vllms_shape_without_auth(client: httpx.Client, node: _Node) -> None:
    """SMG 1.13 identifies a worker by ``GET /version`` (vLLM's route: ``{"version": ...}``)
    before it tries SGLang's info routes; open, as ``/health`` is."""
    from radixmesh import __version__

    resp = client.get("/version", headers={"authorization": ""})
    assert resp.status_code == 200
    assert resp.json() == {"version": __version__, "server": "radixmesh"}


# ------------------------------------------------------------------ guidellm
def test_guidellm_validation_and_stream(client: httpx.Client, node: _Node) -> None:
    assert client.get("/health").status_code == 200
    models = _ok(client.get("/v1/models"))
    assert [m["id"] for m in models["data"]] == [node.engine.model_name]
    body = {"model": node.engine.model_name, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": 8, "ignore_eos": True, "prompt": CONTEXT}
    texts: list[str] = []
    usage: dict[str, Any] | None = None
    done = False
    with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            texts += [c["text"] for c in chunk.get("choices") or []]
            usage = chunk.get("usage") or usage
    assert done and texts
    assert usage is not None and usage["prompt_tokens"] > 0
    assert 0 < usage["completion_tokens"] <= 8
