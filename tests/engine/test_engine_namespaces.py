"""Cache namespaces on the built-in engine (engine/namespaced.py): two namespaces with one prompt
never share KV, one namespace still hits, outputs equal the un-namespaced request's, and the
cache view (index, journal) holds exactly the mesh's namespaced block hashes — also with
chunks that lie inside the virtual block, mixed batches, evictions and preemptions."""

from __future__ import annotations

import random

import pytest

from radixmesh.core.blocks import block_hashes, namespace_seed
from radixmesh.engine.base import GenerateRequest, SamplingParams
from radixmesh.engine.builtin import TransformersEngine
from radixmesh.engine.factory import build_engine
from radixmesh.engine.testing import step_until_done

MAX_NEW = 8


@pytest.fixture(scope="module")
def engine() -> TransformersEngine:
    return build_engine("tiny", cache_tokens=8192, seed=0)


def _req(prompt: list[int], ns: str | None, max_tokens: int = MAX_NEW) -> GenerateRequest:
    return GenerateRequest("r", tuple(prompt), SamplingParams(max_tokens=max_tokens),
                           cache_namespace=ns)


def _prompt(seed: int, n: int = 70) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def _hashes(engine: TransformersEngine, tokens: list[int], ns: str | None) -> set[int]:
    fp = engine.fingerprint
    return set(block_hashes(tokens, fp.block_size, namespace_seed(fp.digest, ns, fp.block_size)))


def test_two_namespaces_never_share_and_one_still_hits(engine: TransformersEngine) -> None:
    engine.clear_cache()
    engine.drain_cache_delta()
    prompt = _prompt(1)
    base = engine.generate(_req(prompt, None))
    first_a = engine.generate(_req(prompt, "tenant-a"))
    assert first_a.cached_tokens == 0  # the shared cache's blocks are not tenant a's
    assert engine.match(prompt, namespace="tenant-a") == 64
    assert engine.match(prompt, namespace="tenant-b") == 0
    second_a = engine.generate(_req(prompt, "tenant-a"))
    first_b = engine.generate(_req(prompt, "tenant-b"))
    assert second_a.cached_tokens == 64 and first_b.cached_tokens == 0
    for r in (first_a, second_a, first_b):
        assert r.output_ids == base.output_ids and r.prompt_tokens == len(prompt)
    # the node's view: exactly the namespaced hashes of prompt + output[:-1], no virtual block
    want = set()
    for ns in (None, "tenant-a", "tenant-b"):
        want |= _hashes(engine, prompt + base.output_ids[:-1], ns)
    assert engine.cache_hashes() == want
    delta = engine.drain_cache_delta()
    assert set(delta.added) == want and not delta.removed


def test_chunks_inside_the_virtual_block_and_mixed_batches() -> None:
    """A 12-token step budget: a namespace's first chunks compute only its virtual block (the
    model runs nothing for them); a batch mixing namespaces equals each request alone."""
    engine = build_engine("tiny", cache_tokens=8192, seed=0, step_tokens=12)
    prompts = [_prompt(s, 40 + 9 * s) for s in range(4)]
    alone = {}
    for i, p in enumerate(prompts):
        engine.clear_cache()
        alone[i] = engine.generate(_req(p, None)).output_ids
    engine.clear_cache()
    engine.drain_cache_delta()
    reqs = [_req(prompts[i % 4], ns) for i, ns in enumerate(["x", "y", None, "x", "y", "z"])]
    ran = engine.stats()["prefill_tokens"]  # (the scheduler's counts restarted at the clear)
    results = step_until_done(engine, reqs)
    stats = engine.stats()
    assert stats["max_batch"] >= 3
    virtual = stats["prefill_tokens_computed"] - (stats["prefill_tokens"] - ran)  # never run
    assert virtual >= 3 * 16 and virtual % 16 == 0  # x, y and z's blocks, each at least once
    for i, r in enumerate(results):
        assert r.output_ids == alone[i % 4], i
    want = set()
    for i, r in enumerate(reqs):
        want |= _hashes(engine, list(r.prompt_ids) + results[i].output_ids[:-1],
                        r.cache_namespace)
    assert engine.cache_hashes() == want


def test_evictions_and_preemptions_keep_the_journal_exact() -> None:
    """A pool far too small for the load: the journal's net adds are the cache, never a
    virtual block, every answer equals the un-namespaced one."""
    engine = build_engine("tiny", cache_tokens=320, seed=0)
    rng = random.Random(7)
    prompts = [_prompt(s, rng.randrange(20, 90)) for s in range(3)]
    alone = []
    for p in prompts:
        engine.clear_cache()
        alone.append(engine.generate(_req(p, None, 12)).output_ids)
    engine.clear_cache()
    engine.drain_cache_delta()
    held: set[int] = set()
    for round_ in range(3):
        picks = [(rng.randrange(3), rng.choice([None, "a", "b", "c"])) for _ in range(6)]
        results = step_until_done(engine, [_req(prompts[i], ns, 12) for i, ns in picks])
        for (i, _), r in zip(picks, results, strict=True):
            assert r.output_ids == alone[i], round_
        delta = engine.drain_cache_delta()
        assert not set(delta.added) & set(delta.removed)
        held = (held - set(delta.removed)) | set(delta.added)
        assert held == engine.cache_hashes()
    assert engine.stats()["preemptions"] + engine.stats()["reclaims"] > 0
