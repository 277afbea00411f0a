"""The paged KV pool: cached-prefix logits equal uncached ones; block ownership stays in step
with the scheduler's counts and its journal; prefixes are shared by reference, never copied;
a step's vectorised slots and batched greedy picks equal their per-sequence references."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixmesh.core.blocks import block_hashes
from radixmesh.engine.base import GenerateRequest, SamplingParams
from radixmesh.engine.builtin import TransformersEngine
from radixmesh.engine.factory import build_engine
from radixmesh.engine.paged_kv import (
    VIEW_LONG_CONTEXT,
    VIEW_MAX_BATCH,
    VIEW_MIN_CONTEXT,
    PagedKV,
)
from radixmesh.engine.sampling import Sampler, greedy_rows
from radixmesh.engine.testing import uncached_logits

ATOL = 1e-4


def micro_engine(cache_tokens: int = 4096, block_size: int = 16) -> TransformersEngine:
    return build_engine("micro", cache_tokens=cache_tokens, block_size=block_size, seed=0)


def random_prompt(rng: random.Random, n: int, vocab: int = 256) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def check_invariants(engine: TransformersEngine) -> None:
    """Every block has one owner; the pool's cached blocks are exactly the scheduler's cache
    (the node's index); nothing is held when idle; nothing was ever copied."""
    runner = engine.runner
    kv, sched = runner.kv, runner.sched
    assert kv.cached_blocks == len(engine.cache_hashes())
    assert kv.free_blocks + kv.cached_blocks == kv.kv_blocks  # idle: no private blocks
    assert sched.kv_used_blocks <= kv.cached_blocks  # the tree counts shared tokens once
    assert engine.usage().locked_tokens == 0
    assert runner.kv_bytes_copied == 0


def assert_prefix_reuse_is_exact(engine: TransformersEngine, prompt: list[int], cached: int):
    logits, got = engine.prefill_logits(prompt)
    assert got == cached
    torch.testing.assert_close(logits, uncached_logits(engine, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("split", [0, 1, 15, 16, 17, 32, 47, 63, 64])
def test_cached_prefix_logits_equal_uncached_at_every_split(split: int) -> None:
    engine = micro_engine()
    prompt = random_prompt(random.Random(split), 64)
    if split:
        engine.prefill_logits(prompt[:split])  # caches the whole blocks of `split` tokens
    cached = min(split, len(prompt) - 1) // 16 * 16
    assert engine.match(prompt) == cached
    assert_prefix_reuse_is_exact(engine, prompt, cached)
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
        assert expected >= min(keep, len(prompt) - 1) // 16 * 16
        assert_prefix_reuse_is_exact(engine, prompt, expected)
    check_invariants(engine)


def test_exact_after_evictions_with_a_small_pool() -> None:
    rng = random.Random(3)
    engine = micro_engine(cache_tokens=160)
    shared = random_prompt(rng, 40)
    prompts = [shared + random_prompt(rng, rng.randrange(5, 60)) for _ in range(10)]
    prompts += [random_prompt(rng, 70) for _ in range(4)]
    for prompt in prompts * 2:
        assert_prefix_reuse_is_exact(engine, prompt, engine.match(prompt))
        check_invariants(engine)
        assert engine.usage().tokens <= 160


def test_pool_accounting_holds_under_random_generation() -> None:
    rng = random.Random(11)
    engine = micro_engine(cache_tokens=112)
    roots = [random_prompt(rng, 30) for _ in range(3)]
    for i in range(25):
        prompt = rng.choice(roots)[: rng.randrange(1, 31)] + random_prompt(
            rng, rng.randrange(0, 50)
        )
        sampling = SamplingParams(max_tokens=rng.randrange(1, 6))
        engine.generate(GenerateRequest(str(i), tuple(prompt), sampling))
        check_invariants(engine)


def test_a_request_that_never_fits_the_pool_is_refused() -> None:
    engine = micro_engine(cache_tokens=32)
    with pytest.raises(ValueError, match="never fit"):
        engine.generate(GenerateRequest("r", tuple(range(40)), SamplingParams(max_tokens=2)))
    check_invariants(engine)


def test_block_hash_journal_tracks_inserts_and_evictions() -> None:
    engine = micro_engine(cache_tokens=64, block_size=16)
    seed = engine.fingerprint.digest
    a = random_prompt(random.Random(1), 50)
    engine.prefill_logits(a)
    delta = engine.drain_cache_delta()
    assert list(delta.added) == block_hashes(a, 16, seed) or set(delta.added) == set(
        block_hashes(a, 16, seed))  # 50 tokens -> 3 full blocks
    assert delta.removed == ()
    assert engine.cache_hashes() == frozenset(delta.added)
    b = random_prompt(random.Random(2), 60)
    engine.prefill_logits(b)  # needs room: `a` is evicted
    delta = engine.drain_cache_delta()
    assert set(delta.removed) == set(block_hashes(a, 16, seed))
    assert set(delta.added) == set(block_hashes(b, 16, seed))
    assert engine.cache_hashes() == frozenset(block_hashes(b, 16, seed))
    check_invariants(engine)


def test_clear_journals_removals() -> None:
    engine = micro_engine()
    a, b = random_prompt(random.Random(1), 40), random_prompt(random.Random(2), 40)
    engine.prefill_logits(a)
    engine.prefill_logits(b)
    engine.drain_cache_delta()
    assert engine.clear_cache() == 64  # two whole blocks each
    assert engine.match(a) == engine.match(b) == 0
    assert len(engine.drain_cache_delta().removed) == 4
    assert engine.usage().tokens == 0 and engine.cache_hashes() == frozenset()
    check_invariants(engine)


def test_a_shared_prefix_is_read_in_place() -> None:
    """Two running sequences over one cached prefix hold the same physical blocks."""
    engine = micro_engine()
    rng = random.Random(4)
    shared = random_prompt(rng, 48)
    engine.prefill_logits([*shared, 1])
    runner = engine.runner
    done: list[object] = []
    for i in range(2):
        req = GenerateRequest(str(i), tuple(shared + random_prompt(rng, 9)),
                              SamplingParams(max_tokens=4))
        runner.submit(req, 4, None, done.append)
    runner.step()  # both admitted, prefix hit
    seqs = list(runner._live)
    heads = [runner.kv.table(seq)[:3] for seq in seqs]
    assert heads[0] == heads[1]
    while len(done) != 2:
        runner.step()
    assert runner.kv_bytes_copied == 0
    assert engine.stats()["cached_tokens_hit"] == 96
    check_invariants(engine)


def _grow_interleaved(kv: PagedKV, want: dict[int, int], rng: random.Random) -> None:
    """Grow each sequence's table a block at a time, the sequences in random turn."""
    bs = kv.block_size
    while short := [s for s, n in want.items() if len(kv.table(s)) * bs < n]:
        seq = rng.choice(short)
        kv.ensure(seq, (len(kv.table(seq)) + 1) * bs, lambda: False)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 120), min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_decode_slots_match_each_sequence_s_table(contexts: list[int], rng: random.Random
                                                  ) -> None:
    """A decode whose context is one run of consecutive blocks (at least VIEW_MIN_CONTEXT in a
    step of few decodes, else VIEW_LONG_CONTEXT) is read as a view from its first slot;
    every other one gets the vectorised padded slots,
    equal to the per-sequence reference (slot ``i`` is block ``i // bs`` at offset ``i % bs``,
    past its context the null slot, masked); every new token is written at its last slot."""
    bs = 4
    kv = PagedKV(1, 1, 1, 256, bs, torch.float32, torch.device("cpu"))
    want = {}
    for seq, ctx in enumerate(contexts):  # some expect their length: their blocks stay a run
        kv.admit(seq, [], 0, rng.choice([0, ctx + bs]))
        want[seq] = ctx + rng.randrange(2) * bs  # a spare block sometimes
    _grow_interleaved(kv, want, rng)
    batch = kv.batch([], list(enumerate(contexts)))
    views = {row: (first, n) for row, first, n in batch.decode_views}
    rows = [] if batch.decode_rows is None else batch.decode_rows.tolist()
    assert sorted(rows + list(views)) == list(range(len(contexts)))
    for seq, ctx in enumerate(contexts):
        table = kv.table(seq)
        want_slots = [table[i // bs] * bs + i % bs for i in range(ctx)]
        least = VIEW_MIN_CONTEXT if len(contexts) <= VIEW_MAX_BATCH else VIEW_LONG_CONTEXT
        if want_slots == list(range(want_slots[0], want_slots[0] + ctx)) and ctx >= least:
            assert views[seq] == (want_slots[0], ctx)
            continue
        assert batch.decode_slots is not None and batch.decode_mask is not None
        j = rows.index(seq)
        width = batch.decode_slots.shape[1]
        assert width >= ctx
        assert batch.decode_slots[j].tolist() == want_slots + [kv.null_slot] * (width - ctx)
        assert batch.decode_mask[j, 0, 0].tolist() == [i < ctx for i in range(width)]
    assert not batch.write_runs and [row for row, _ in batch.writes] == [0]
    assert batch.writes[0][1].tolist() == [kv.table(s)[(c - 1) // bs] * bs + (c - 1) % bs
                                           for s, c in enumerate(contexts)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 60)), min_size=1, max_size=5),
       st.randoms(use_true_random=False))
def test_prefill_rows_write_and_read_their_slots(chunks: list[tuple[int, int]],
                                                 rng: random.Random) -> None:
    """Each prefill chunk's rows are written to its positions' slots (a slice where they are
    consecutive) and it reads its whole context's slots (a view where they are one run)."""
    bs = 4
    kv = PagedKV(1, 1, 1, 256, bs, torch.float32, torch.device("cpu"))
    want = {}
    for seq, (start, n) in enumerate(chunks):
        kv.admit(seq, [], 0, rng.choice([0, start + n]))
        want[seq] = start + n
    _grow_interleaved(kv, want, rng)
    batch = kv.batch([(seq, start, n) for seq, (start, n) in enumerate(chunks)], [])
    written: dict[int, int] = {}
    for row, n, first in batch.write_runs:
        written.update((row + i, first + i) for i in range(n))
    for row, slots in batch.writes:
        written.update((row + i, s) for i, s in enumerate(slots.tolist()))
    row = 0
    for seq, (start, n) in enumerate(chunks):
        ctx = kv.slots(seq, 0, start + n).tolist()
        assert [written[row + i] for i in range(n)] == ctx[start:]
        p_row, p_n, p_start, p_ctx = batch.prefills[seq]
        assert (p_row, p_n, p_start) == (row, n, start)
        if isinstance(p_ctx, int):
            assert ctx == list(range(p_ctx, p_ctx + start + n))
        else:
            assert p_ctx.tolist() == ctx
        row += n
    assert sorted(written) == list(range(row))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_sequences_grown_together_keep_one_run_each(blocks: list[int], rng: random.Random
                                                    ) -> None:
    """Sequences admitted with their expected length and grown in random turn each hold one
    run of consecutive blocks while the pool has room (here, over what others left behind);
    the pool's free count stays its blocks less those held."""
    bs = 4
    kv = PagedKV(1, 1, 1, 512, bs, torch.float32, torch.device("cpu"))
    for seq in range(3):  # leave holes behind: blocks taken, some given back
        kv.admit(100 + seq, [], 0)
        kv.ensure(100 + seq, rng.randrange(1, 30) * bs, lambda: False)
    kv.drop(101)
    want = {}
    for seq, n in enumerate(blocks):
        kv.admit(seq, [], 0, n * bs)
        want[seq] = n * bs
    _grow_interleaved(kv, want, rng)
    for seq, n in enumerate(blocks):
        table = kv.table(seq)
        assert table == list(range(table[0], table[0] + n))
    held = sum(len(kv.table(s)) for s in [100, 102, *want])
    assert kv.free_blocks == kv.kv_blocks - held
    for seq in [100, 102, *want]:
        kv.drop(seq)
    assert kv.free_blocks == kv.kv_blocks


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_greedy_rows_pick_what_each_sampler_picks(n: int, seed: int) -> None:
    """One argmax over a batch's plain-greedy rows = each row's own greedy ``Sampler.next``
    (ties included: rows drawn from few distinct values)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 3, (n, 50), generator=gen).float()
    which = [i for i in range(n) if (seed >> i) & 1]
    sampler = Sampler(SamplingParams(max_tokens=1, temperature=0.0), 50, torch.device("cpu"))
    assert sampler.plain_greedy
    assert greedy_rows(rows, which) == [sampler.next(rows[i])[0] for i in which]
