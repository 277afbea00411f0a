"""The built-in engine's penalties and log-probabilities against a direct computation with the
same model: one plain forward pass of the whole sequence, no cache involved."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from radixmesh.engine.base import GenerateRequest, SamplingParams, TokenLogprob
from radixmesh.engine.factory import build_engine

PROMPT = list(b"The quick brown fox jumps over the lazy dog. " * 3)
LONG = list(b"Pack my box with five dozen liquor jugs. " * 30)  # > SCORE_CHUNK tokens


@pytest.fixture(scope="module")
def engine() -> Any:
    return build_engine("tiny", cache_tokens=8192, threads=1)


def _full_logprobs(engine: Any, ids: list[int]) -> torch.Tensor:
    """log_softmax of every position's logits (tokenizer vocabulary), one uncached pass."""
    with torch.inference_mode():
        x = torch.tensor([ids], dtype=torch.long)
        logits = engine.model(input_ids=x).logits[0, :, : engine._allowed].float()
    return torch.log_softmax(logits, dim=-1)


def _run(engine: Any, prompt: list[int], **sampling: Any) -> Any:
    return engine.generate(GenerateRequest("t", tuple(prompt), SamplingParams(**sampling)))


def test_prompt_logprobs_equal_a_full_forward_pass_even_with_a_cached_prefix(engine: Any
                                                                             ) -> None:
    engine.clear_cache()
    _run(engine, PROMPT[:-5], max_tokens=4)  # most of the prompt is cached now
    assert engine.match(PROMPT) > 0
    res = _run(engine, PROMPT, max_tokens=1, prompt_logprobs=3, logprobs=3)
    assert res.cached_tokens == 0  # scoring computes the whole prompt (no logits in the cache)
    ref = _full_logprobs(engine, PROMPT + res.output_ids)
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(PROMPT)
    for i, entry in enumerate(res.prompt_logprobs[1:], start=1):
        assert isinstance(entry, TokenLogprob) and entry.token_id == PROMPT[i]
        assert entry.logprob == pytest.approx(ref[i - 1, PROMPT[i]].item(), abs=1e-4)
        values, ids = torch.topk(ref[i - 1], 3)
        assert [t for t, _ in entry.top] == ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
    (gen,) = res.logprobs[: len(res.output_ids)] or res.logprobs  # 1 token, or the stop token
    assert gen.logprob == pytest.approx(ref[len(PROMPT) - 1, gen.token_id].item(), abs=1e-4)


def test_max_tokens_zero_scores_the_prompt_only(engine: Any) -> None:
    res = _run(engine, PROMPT, max_tokens=0, prompt_logprobs=0)
    assert res.output_ids == [] and res.logprobs == ()
    assert len(res.prompt_logprobs) == len(PROMPT)
    assert all(e is None or e.top == () for e in res.prompt_logprobs)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def test_generated_logprobs_match_a_full_pass_over_the_answer(engine: Any) -> None:
    res = _run(engine, PROMPT, max_tokens=12, logprobs=2)
    ref = _full_logprobs(engine, PROMPT + res.output_ids)
    assert len(res.logprobs) in (len(res.output_ids), len(res.output_ids) + 1)
    for j, entry in enumerate(res.logprobs):
        row = ref[len(PROMPT) - 1 + j]
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        assert entry.top[0][0] == int(torch.argmax(row))  # greedy: the top one is chosen
        assert entry.token_id == entry.top[0][0]


def _penalized_greedy(engine: Any, prompt: list[int], n: int, presence: float,
                      frequency: float) -> list[int]:
    """Greedy decoding with OpenAI's penalties, by full forward passes (the reference)."""
    out: list[int] = []
    for _ in range(n):
        logits = _last_logits(engine, prompt + out)
        counts = torch.zeros_like(logits)
        for tok in out:
            counts[tok] += 1
        logits = logits - counts * frequency - (counts > 0).float() * presence
        out.append(int(torch.argmax(logits)))
    return out


def _last_logits(engine: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        x = torch.tensor([ids], dtype=torch.long)
        return engine.model(input_ids=x).logits[0, -1, : engine._allowed].float()


@pytest.mark.parametrize(("presence", "frequency"), [(2.0, 0.0), (0.0, 2.0), (1.0, 1.5)])
def test_penalties_follow_openai_semantics(engine: Any, presence: float, frequency: float
                                           ) -> None:
    plain = _run(engine, PROMPT, max_tokens=10).output_ids
    res = _run(engine, PROMPT, max_tokens=10, presence_penalty=presence,
               frequency_penalty=frequency)
    expected = _penalized_greedy(engine, PROMPT, 10, presence, frequency)
    got = res.output_ids
    assert got == expected[: len(got)] and got
    assert got != plain[: len(got)]  # the penalties changed the answer


def test_a_prompt_longer_than_a_scoring_chunk_is_scored_exactly(engine: Any) -> None:
    from radixmesh.engine.sampling import SCORE_CHUNK

    assert len(LONG) > 2 * SCORE_CHUNK
    res = _run(engine, LONG, max_tokens=1, prompt_logprobs=1, logprobs=0)
    ref = _full_logprobs(engine, LONG)
    got = torch.tensor([e.logprob for e in res.prompt_logprobs[1:]])  # type: ignore[union-attr]
    want = ref[:-1].gather(1, torch.tensor(LONG[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(got, want, atol=1e-4)
    assert res.logprobs[0].logprob == pytest.approx(
        ref[-1, res.logprobs[0].token_id].item(), abs=1e-4)
