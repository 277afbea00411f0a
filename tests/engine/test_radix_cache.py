"""The radix KV cache: cached-prefix logits equal uncached ones; budget; locks; invariants."""

from __future__ import annotations

import random

import pytest
import torch

from radixmesh.core.blocks import block_hashes
from radixmesh.engine.builtin import TransformersEngine
from radixmesh.engine.factory import build_engine
from radixmesh.engine.radix_cache import GrowingLayer, RadixKVCache
from radixmesh.engine.testing import uncached_logits

ATOL = 1e-4


def micro_engine(cache_tokens: int = 4096, block_size: int = 16) -> TransformersEngine:
    return build_engine("micro", cache_tokens=cache_tokens, block_size=block_size, seed=0)


def random_prompt(rng: random.Random, n: int, vocab: int = 256) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def check_invariants(engine: TransformersEngine) -> None:
    """Every node's KV covers exactly its segment; totals add up; budget holds."""
    cache = engine.cache
    tree = cache.tree
    total, stack = 0, list(tree.root.children.values())
    while stack:
        node = stack.pop()
        assert node.value is not None
        assert node.value.shape[3] == len(node.key)
        assert node.value.shape[:3] == (engine.model.config.num_hidden_layers, 2, 2)
        total += len(node.key)
        stack.extend(node.children.values())
    assert total == tree.total_tokens <= cache.budget


def assert_prefix_reuse_is_exact(engine: TransformersEngine, prompt: list[int], cached: int):
    logits, got = engine.prefill_logits(prompt)
    assert got == cached
    torch.testing.assert_close(logits, uncached_logits(engine, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("split", [0, 1, 15, 16, 17, 32, 47, 63, 64])
def test_cached_prefix_logits_equal_uncached_at_every_split(split: int) -> None:
    engine = micro_engine()
    prompt = random_prompt(random.Random(split), 64)
    if split:
        engine.prefill_logits(prompt[:split])  # caches exactly `split` tokens
    assert engine.match(prompt) == min(split, len(prompt) - 1)
    assert_prefix_reuse_is_exact(engine, prompt, min(split, len(prompt) - 1))
    check_invariants(engine)


def test_random_prompts_and_divergent_prefixes() -> None:
    rng = random.Random(7)
    engine = micro_engine()
    base = random_prompt(rng, 120)
    engine.prefill_logits(base)
    for _ in range(12):
        keep = rng.randrange(0, 121)
        prompt = base[:keep] + random_prompt(rng, rng.randrange(1, 40))
        expected = engine.match(prompt)
        assert expected >= min(keep, len(prompt) - 1)
        assert_prefix_reuse_is_exact(engine, prompt, expected)
    check_invariants(engine)


def test_exact_after_evictions_with_a_small_budget() -> None:
    rng = random.Random(3)
    engine = micro_engine(cache_tokens=150)
    shared = random_prompt(rng, 40)
    prompts = [shared + random_prompt(rng, rng.randrange(5, 60)) for _ in range(10)]
    prompts += [random_prompt(rng, 70) for _ in range(4)]
    for prompt in prompts * 2:
        assert_prefix_reuse_is_exact(engine, prompt, engine.match(prompt))
        check_invariants(engine)
        assert engine.usage().tokens <= 150
    assert engine.cache.evicted_tokens > 0


def test_budget_never_exceeded_under_random_generation() -> None:
    from radixmesh.engine.base import GenerateRequest, SamplingParams

    rng = random.Random(11)
    engine = micro_engine(cache_tokens=100)
    roots = [random_prompt(rng, 30) for _ in range(3)]
    for i in range(25):
        prompt = rng.choice(roots)[: rng.randrange(1, 31)] + random_prompt(
            rng, rng.randrange(0, 50)
        )
        sampling = SamplingParams(max_tokens=rng.randrange(1, 6))
        engine.generate(GenerateRequest(str(i), tuple(prompt), sampling))
        check_invariants(engine)
        usage = engine.usage()
        assert usage.tokens <= usage.budget == 100
        assert usage.locked_tokens == 0


def test_zero_budget_caches_nothing_but_still_serves() -> None:
    engine = micro_engine(cache_tokens=0)
    prompt = random_prompt(random.Random(1), 40)
    for _ in range(2):
        assert_prefix_reuse_is_exact(engine, prompt, 0)
    assert engine.usage().tokens == 0
    assert engine.cache_hashes() == frozenset()


def test_locked_path_survives_concurrent_inserts() -> None:
    rng = random.Random(5)
    engine = micro_engine(cache_tokens=120)
    prompt = random_prompt(rng, 80)
    engine.prefill_logits(prompt[:64])
    lease = engine.cache.acquire(prompt, 16, now=1e9)  # a request is running on prompt[:64]
    assert lease.cached == 64
    for i in range(6):  # other requests' inserts need room: only unlocked leaves may go
        other = random_prompt(random.Random(100 + i), 50)
        engine.prefill_logits(other)
        assert engine.cache.match(prompt) >= 64
        check_invariants(engine)
    engine.cache.release(lease)
    assert engine.usage().locked_tokens == 0
    engine.prefill_logits(random_prompt(rng, 110))  # now the old path may be evicted
    assert engine.cache.match(prompt) < 64
    check_invariants(engine)


def test_block_hash_journal_tracks_inserts_and_evictions() -> None:
    engine = micro_engine(cache_tokens=64, block_size=16)
    seed = engine.fingerprint.digest
    a = random_prompt(random.Random(1), 50)
    engine.prefill_logits(a)
    delta = engine.drain_cache_delta()
    assert list(delta.added) == block_hashes(a, 16, seed)  # 50 tokens -> 3 full blocks
    assert delta.removed == ()
    assert engine.cache_hashes() == frozenset(delta.added)
    b = random_prompt(random.Random(2), 60)
    engine.prefill_logits(b)  # needs room: `a` is evicted
    delta = engine.drain_cache_delta()
    assert set(delta.removed) == set(block_hashes(a, 16, seed))
    assert set(delta.added) == set(block_hashes(b, 16, seed))
    assert engine.cache_hashes() == frozenset(block_hashes(b, 16, seed))


def test_clear_keeps_locked_paths_and_journals_removals() -> None:
    engine = micro_engine()
    a, b = random_prompt(random.Random(1), 40), random_prompt(random.Random(2), 40)
    engine.prefill_logits(a)
    engine.prefill_logits(b)
    engine.drain_cache_delta()
    lease = engine.cache.acquire(a, 0, now=1e9)
    # b (40) + a's last token: the lease locks a[:39], splitting off a[39:] as a free leaf
    assert engine.clear_cache() == 41
    assert engine.match(a) == 39 and engine.match(b) == 0
    assert len(engine.drain_cache_delta().removed) == 2  # b's two full blocks
    engine.cache.release(lease)
    engine.clear_cache()
    assert engine.usage().tokens == 0 and engine.cache_hashes() == frozenset()


def test_stored_values_are_copies_not_views() -> None:
    engine = micro_engine()
    engine.prefill_logits(random_prompt(random.Random(2), 40))
    node = next(iter(engine.cache.tree.root.children.values()))
    assert node.value is not None
    assert node.value.is_contiguous()
    assert node.value.untyped_storage().nbytes() == node.value.numel() * node.value.element_size()


def test_negative_budget_rejected() -> None:
    with pytest.raises(ValueError):
        RadixKVCache(-1, 16, 0)


def test_growing_layer_matches_concatenation_across_growth() -> None:
    torch.manual_seed(0)
    segs = [torch.randn(2, 2, t, 8) for t in (3, 5)]
    layer = GrowingLayer(capacity=9, segments=segs)
    chunks = [torch.randn(1, 2, t, 8) for t in (1, 4, 7, 1)]
    ref_k = torch.cat([s[0].unsqueeze(0) for s in segs], dim=2)
    for c in chunks:
        keys, values = layer.update(c, c * 2)
        ref_k = torch.cat([ref_k, c], dim=2)
        assert torch.equal(keys, ref_k)
        assert torch.equal(values[:, :, 8:], ref_k[:, :, 8:] * 2)
    assert layer.get_seq_length() == 8 + 13
    segs[0].zero_()  # the buffer holds copies, never views of the tree's tensors
    assert torch.equal(layer.keys[:, :, :3], ref_k[:, :, :3])
