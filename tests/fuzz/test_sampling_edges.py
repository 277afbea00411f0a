"""Regression (found by the schemathesis run): extreme but valid sampling values never crash.

``temperature=1e-300`` made ``softmax(logits / T)`` NaN and ``torch.multinomial`` raise (a 500
from the API); ``top_p=1e-300`` rounded to 0 in fp32 and zeroed every token.
"""

from __future__ import annotations

from functools import cache

import pytest

from radixmesh.engine.base import GenerateRequest, SamplingParams
from radixmesh.engine.factory import build_engine


@cache
def engine() -> object:
    return build_engine("micro", cache_tokens=2048)


@pytest.mark.parametrize(
    ("temperature", "top_p"),
    [(5e-324, 1.0), (1e-300, 1.0), (1e-6, 1.0), (0.7, 5e-324), (0.7, 1e-45), (2.0, 1e-9),
     (2.0, 1.0)],
)
def test_extreme_sampling_values(temperature: float, top_p: float) -> None:
    eng = engine()
    req = GenerateRequest("r", tuple(range(1, 40)),
                          SamplingParams(max_tokens=3, temperature=temperature, top_p=top_p,
                                         seed=3))
    out = eng.generate(req).output_ids  # type: ignore[attr-defined]
    vocab = eng.tokenizer.vocab_size  # type: ignore[attr-defined]
    assert len(out) <= 3 and all(0 <= t < vocab for t in out)
    if temperature < 1e-5 or top_p < 1e-30:  # effectively greedy
        greedy = eng.generate(GenerateRequest(  # type: ignore[attr-defined]
            "g", tuple(range(1, 40)), SamplingParams(max_tokens=3, temperature=0.0)))
        assert out == greedy.output_ids
