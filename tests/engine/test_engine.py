"""Generation through the built-in engine: the cache never changes an answer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from radixmesh.engine.base import GenerateRequest, SamplingParams
from radixmesh.engine.builtin import TransformersEngine
from radixmesh.engine.factory import build_engine, model_dir_digest
from radixmesh.engine.testing import save_random_model_dir, uncached_logits
from radixmesh.engine.tokenizers import ByteTokenizer


def micro(cache_tokens: int = 4096) -> TransformersEngine:
    return build_engine("micro", cache_tokens=cache_tokens, seed=0)


def whole_blocks(tokens: int, block_size: int = 16) -> int:
    """A prefix is reused in whole KV blocks (the paged pool's unit, as vLLM)."""
    return tokens // block_size * block_size


def req(prompt: list[int], **sampling: object) -> GenerateRequest:
    return GenerateRequest("r", tuple(prompt), SamplingParams(**sampling))  # type: ignore[arg-type]


def prompts(seed: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(48)]
    return shared + [rng.randrange(256) for _ in range(20)], [*shared, 7, 8, 9]


@pytest.mark.parametrize(
    "sampling",
    [{"max_tokens": 10}, {"max_tokens": 10, "temperature": 0.9, "top_p": 0.8, "seed": 3}],
)
def test_outputs_identical_whatever_the_cache_state(sampling: dict[str, object]) -> None:
    prompt, sibling = prompts(1)
    cold = micro().generate(req(prompt, **sampling))
    assert cold.cached_tokens == 0

    warm = micro()  # the same prompt seen before: its whole blocks but the last token cached
    first = warm.generate(req(prompt, **sampling))
    again = warm.generate(req(prompt, **sampling))
    assert again.cached_tokens == whole_blocks(len(prompt) - 1)

    partial = micro()  # a sibling shares 48 tokens
    partial.generate(req(sibling, max_tokens=1))
    part = partial.generate(req(prompt, **sampling))
    assert part.cached_tokens == 48

    evicted = micro(cache_tokens=80)  # cached, then pushed out by other work
    evicted.generate(req(prompt, max_tokens=2))
    evicted.generate(req([200 - i for i in range(75)], max_tokens=2))
    ev = evicted.generate(req(prompt, **sampling))
    assert ev.cached_tokens == 0

    outputs = [r.output_ids for r in (cold, first, again, part, ev)]
    assert all(o == cold.output_ids for o in outputs)
    assert len(cold.output_ids) == 10 and cold.finish_reason == "length"


def test_generated_tokens_are_cached_for_the_next_turn() -> None:
    engine = micro()
    prompt, _ = prompts(2)
    out = engine.generate(req(prompt, max_tokens=6)).output_ids
    follow = prompt + out + [1, 2, 3]
    res = engine.generate(req(follow, max_tokens=1))
    # the last sampled token had no KV; reuse is in whole blocks
    assert res.cached_tokens == whole_blocks(len(prompt) + len(out) - 1)
    ref = micro().generate(req(follow, max_tokens=1))
    assert res.output_ids == ref.output_ids


def test_seeded_sampling_is_reproducible_and_differs_from_greedy() -> None:
    prompt, _ = prompts(3)
    engine = micro()
    a = engine.generate(req(prompt, max_tokens=12, temperature=1.5, seed=9)).output_ids
    b = engine.generate(req(prompt, max_tokens=12, temperature=1.5, seed=9)).output_ids
    greedy = engine.generate(req(prompt, max_tokens=12)).output_ids
    assert a == b
    assert a != greedy
    assert all(0 <= t < engine.tokenizer.vocab_size for t in a)  # padded vocab is masked


def test_stop_tokens_end_generation_and_are_not_emitted() -> None:
    prompt, _ = prompts(4)
    engine = micro()
    free = engine.generate(req(prompt, max_tokens=5)).output_ids
    stopped = engine.generate(req(prompt, max_tokens=5, stop_token_ids=(free[2],)))
    cut = free.index(free[2])
    assert stopped.output_ids == free[:cut]
    assert stopped.finish_reason == "stop"


def test_eos_and_end_of_turn_stop() -> None:
    prompt, _ = prompts(5)
    first = micro().generate(req(prompt, max_tokens=1)).output_ids[0]
    engine = build_engine("micro", tokenizer=_EosTokenizer(first))  # EOS = the greedy answer
    res = engine.generate(req(prompt, max_tokens=4))
    assert res.output_ids == [] and res.finish_reason == "stop"
    byte_tok = ByteTokenizer()
    assert byte_tok.special_id("<|im_end|>") in byte_tok.stop_ids


class _EosTokenizer(ByteTokenizer):
    def __init__(self, eos: int) -> None:
        super().__init__()
        self._eos = eos

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self._eos})


def test_on_token_streams_every_output_token() -> None:
    seen: list[int] = []
    res = micro().generate(req(prompts(6)[0], max_tokens=7), on_token=seen.append)
    assert seen == res.output_ids
    assert res.prefill_s > 0 and res.decode_s > 0


def test_failing_callback_unlocks_and_keeps_the_computed_kv() -> None:
    engine = micro()
    prompt, _ = prompts(7)

    def boom(token: int) -> None:
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError, match="went away"):
        engine.generate(req(prompt, max_tokens=5), on_token=boom)
    assert engine.usage().locked_tokens == 0
    assert engine.match(prompt) == whole_blocks(len(prompt) - 1)  # published at prefill end


def test_context_limit_truncates_generation() -> None:
    engine = micro()
    n = engine.max_context - 3
    res = engine.generate(req([5] * n, max_tokens=50))
    assert len(res.output_ids) == 3 and res.finish_reason == "length"


@pytest.mark.parametrize("prompt", [[], [1] * 4096, [-1, 2], [512]])
def test_invalid_prompts_raise_value_error(prompt: list[int]) -> None:
    engine = micro()
    with pytest.raises(ValueError):
        engine.generate(req(prompt))
    assert engine.usage().locked_tokens == 0


def test_presets_are_deterministic_and_seeded() -> None:
    state = torch.random.get_rng_state()
    a, b, c = micro(), micro(), build_engine("micro", seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    prompt = prompts(8)[0]
    assert torch.equal(uncached_logits(a, prompt), uncached_logits(b, prompt))
    assert not torch.equal(uncached_logits(a, prompt), uncached_logits(c, prompt))
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert a.fingerprint.model == "preset:micro:seed0:float32"


def test_tiny_preset_shape_and_exact_reuse() -> None:
    engine = build_engine("tiny", cache_tokens=2048)
    assert 11_000_000 < sum(p.numel() for p in engine.model.parameters()) < 13_000_000
    assert engine.kv_bytes_per_token == 4 * 2 * 2 * 64 * 4
    assert engine.max_context == 4096
    text = "The following are multiple choice questions (with answers) about anatomy.\n\n"
    prompt = engine.tokenizer.encode(text * 4)
    n = len(prompt)
    reference = uncached_logits(engine, prompt)
    for split in (1, 16, 200, n - 1, n):
        engine.clear_cache()
        engine.prefill_logits(prompt[:split])
        logits, cached = engine.prefill_logits(prompt)
        assert cached == whole_blocks(min(split, n - 1))
        torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0)


def test_model_dir_loads_offline_with_identical_logits(micro_model_dir: Path) -> None:
    loaded = build_engine(model_path=micro_model_dir, cache_tokens=1024)
    memory = micro()
    prompt = loaded.tokenizer.encode("Question: What is the unit of force? Answer:")
    torch.testing.assert_close(
        uncached_logits(loaded, prompt), uncached_logits(memory, prompt), atol=0, rtol=0
    )
    assert loaded.fingerprint.model.startswith("dir:")
    assert loaded.fingerprint.tokenizer.startswith("hf:")
    assert loaded.tokenizer.eos_token_id == 0
    assert loaded.model_name == micro_model_dir.name
    chat = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert loaded.generate(req(chat, max_tokens=3)).prompt_tokens == len(chat)


def test_model_dir_digest_tells_seeds_apart(tmp_path: Path) -> None:
    a = save_random_model_dir(tmp_path / "a", preset="micro", seed=0)
    b = save_random_model_dir(tmp_path / "b", preset="micro", seed=1)
    assert model_dir_digest(a) != model_dir_digest(b)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"preset": "nope"},
        {"dtype": "int8"},
        {"cache_tokens": -1},
        {"threads": 0},
        {"device": "cuda:0" if not torch.cuda.is_available() else "nope"},
    ],
)
def test_bad_build_arguments(kwargs: dict[str, object]) -> None:
    with pytest.raises((ValueError, RuntimeError)):
        build_engine(**kwargs)  # type: ignore[arg-type]


def test_not_a_model_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        build_engine(model_path=tmp_path)
