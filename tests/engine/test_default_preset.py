"""The default preset takes real prompts: a shipped BPE tokenizer, >= 32k positions."""

from __future__ import annotations

import random

from radixmesh.engine import bpe
from radixmesh.engine.base import GenerateRequest, SamplingParams
from radixmesh.engine.factory import build_engine
from radixmesh.engine.presets import DEFAULT_PRESET, get_preset
from radixmesh.workload.synthetic import words


def test_default_preset_is_bpe_with_a_long_context() -> None:
    spec = get_preset(DEFAULT_PRESET)
    assert spec.max_position_embeddings >= 32_768 and spec.tokenizer == "bpe8k"
    tok = bpe.load()
    assert tok.vocab_size == spec.vocab_size == 8192
    assert tok.fingerprint == bpe.load().fingerprint  # the shipped file: every peer agrees
    text = "The following are multiple choice questions (with answers) about anatomy.\n" * 20
    assert len(tok.encode(text)) * 3 < len(text.encode())  # >= 3 bytes per token on English
    for sample in (text, "héllo 日本語 ✓ {\"tool\": [1, 2]}\n\tdef f(x): return x"):
        assert tok.decode(tok.encode(sample)) == sample  # byte-level: lossless
    assert tok.eos_token_id is not None and tok.eos_token_id in tok.stop_ids


def test_a_prompt_beyond_the_old_4k_limit_is_served() -> None:
    engine = build_engine()  # the default
    assert engine.model_name == DEFAULT_PRESET and engine.max_context >= 32_768
    prompt = engine.tokenizer.encode(words(random.Random(0), 13_000))
    assert 4096 < len(prompt) < engine.max_context
    res = engine.generate(GenerateRequest("long", tuple(prompt), SamplingParams(max_tokens=2)))
    assert res.prompt_tokens == len(prompt) and len(res.output_ids) <= 2
    again = engine.generate(GenerateRequest("long", tuple(prompt), SamplingParams(max_tokens=2)))
    assert again.cached_tokens == (len(prompt) - 1) // 16 * 16
    assert again.output_ids == res.output_ids
    assert engine.stats()["kv_bytes_copied"] == 0
