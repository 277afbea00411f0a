"""EngineIndex: radixmesh block hashes rebuilt exactly from vLLM / SGLang KV events."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixmesh.core.blocks import Fingerprint, block_hashes
from radixmesh.core.engine_index import EngineConfigError, EngineIndex, check_block_sizes
from radixmesh.core.kv_events import (
    EngineAllCleared,
    EngineBlockRemoved,
    EngineBlockStored,
    KvBatch,
    UnknownEngineEvent,
    decode_batch,
)

B = 16
SEED = Fingerprint("m", "t", B).digest


def toks(n: int, seed: int = 0) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(50_000) for _ in range(n))


def stored(hashes: list[Any], parent: Any, tokens: tuple[int, ...], **kw: Any) -> KvBatch:
    size = len(tokens) // len(hashes)
    return KvBatch(0.0, (EngineBlockStored(tuple(hashes), parent, tokens, size, **kw),))


def removed(*hashes: Any, **kw: Any) -> KvBatch:
    return KvBatch(0.0, (EngineBlockRemoved(tuple(hashes), **kw),))


class FakeEngine:
    """An engine's prefix cache as a set of page-aligned token prefixes; emits its events."""

    def __init__(self, page: int, style: str, hash_kind: str, encoding: str) -> None:
        self.page, self.style, self.hash_kind, self.encoding = page, style, hash_kind, encoding
        self.present: set[tuple[int, ...]] = set()
        self.pending: list[Any] = []
        self.ts = 0.0

    def key(self, prefix: tuple[int, ...]) -> int | bytes:
        digest = hashlib.sha256(repr(prefix).encode()).digest()
        if self.hash_kind == "bytes":
            return digest[:16]
        return int.from_bytes(digest[:8], "big", signed=self.hash_kind == "i64")

    def insert(self, tokens: tuple[int, ...]) -> None:
        run: list[int] = []
        for j in range(len(tokens) // self.page):
            prefix = tokens[: (j + 1) * self.page]
            if prefix in self.present:
                self._flush(run, tokens)
                run = []
                continue
            self.present.add(prefix)
            run.append(j)
            if self.style == "sglang":  # one event per page
                self._flush(run, tokens)
                run = []
        self._flush(run, tokens)

    def _flush(self, run: list[int], tokens: tuple[int, ...]) -> None:
        if not run:
            return
        p = self.page
        first, end = run[0], run[-1] + 1
        fields = {
            "type": "BlockStored",
            "block_hashes": [self.key(tokens[: (j + 1) * p]) for j in run],
            "parent_block_hash": self.key(tokens[: first * p]) if first else None,
            "token_ids": list(tokens[first * p : end * p]),
            "block_size": p,
            "lora_id": None,
            "medium": "GPU",
        }
        self._emit(fields)

    def remove(self, prefixes: list[tuple[int, ...]]) -> None:
        self.present -= set(prefixes)
        self._emit({"type": "BlockRemoved", "block_hashes": [self.key(x) for x in prefixes]})

    def clear(self) -> None:
        self.present.clear()
        self._emit({"type": "AllBlocksCleared"})

    def _emit(self, fields: dict[str, Any]) -> None:
        if self.encoding == "map":
            self.pending.append({k: v for k, v in fields.items() if v is not None})
        else:
            order = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids",
                                     "block_size", "lora_id", "medium"),
                     "BlockRemoved": ("block_hashes",), "AllBlocksCleared": ()}  # fmt: skip
            self.pending.append([fields["type"], *(fields[k] for k in order[fields["type"]])])

    def payload(self) -> bytes:
        self.ts += 1.0
        batch, self.pending = [self.ts, self.pending, 0], []
        return bytes(msgpack.packb(batch))

    def reference(self) -> set[int]:
        """Hashes of every prefix the engine can serve: all its pages up to the root held."""
        reachable: set[tuple[int, ...]] = set()
        for prefix in sorted(self.present, key=len):
            if len(prefix) == self.page or prefix[: -self.page] in reachable:
                reachable.add(prefix)
        out: set[int] = set()
        for prefix in reachable:
            out.update(block_hashes(prefix, B, SEED))
        return out


BASES = [toks(160, seed) for seed in range(4)]
OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("insert"),
            st.integers(0, 3),  # base prefix
            st.integers(0, 160),  # tokens of it kept
            st.integers(0, 96),  # random tail tokens
            st.integers(0, 2**32),  # their seed
        ),
        st.tuples(st.just("remove"), st.integers(0, 10**6), st.integers(1, 5)),
        st.tuples(st.just("clear")),
    ),
    max_size=20,
)
ENGINES = [
    ("vllm", 16, "u64", "tagged"),
    ("vllm", 16, "bytes", "map"),
    ("vllm", 32, "u64", "map"),
    ("vllm", 64, "i64", "tagged"),
    ("sglang", 1, "i64", "map"),
    ("sglang", 4, "i64", "map"),
    ("sglang", 16, "i64", "map"),
    ("sglang", 64, "i64", "map"),
]


def _run_op(engine: FakeEngine, op: tuple[Any, ...]) -> None:
    if op[0] == "insert":
        _, base, cut, tail, seed = op
        engine.insert(BASES[base][:cut] + toks(tail, seed))
    elif op[0] == "remove" and engine.present:
        everything = sorted(engine.present)
        engine.remove(sorted({everything[(op[1] + 7 * i) % len(everything)]
                              for i in range(op[2])}))  # fmt: skip
    elif op[0] == "clear":
        engine.clear()


@pytest.mark.parametrize(("style", "page", "hash_kind", "encoding"), ENGINES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, query=st.tuples(st.integers(0, 3), st.integers(0, 160), st.integers(0, 2**32)))
def test_index_equals_the_reference_from_the_engines_prefixes(
    style: str, page: int, hash_kind: str, encoding: str, ops: list[Any], query: Any
) -> None:
    engine = FakeEngine(page, style, hash_kind, encoding)
    index = EngineIndex(B, SEED, engine_block_size=page)
    expected: set[int] = set()
    mirror: set[int] = set()  # what a NodeCore fed only the deltas would hold
    for op in ops:
        _run_op(engine, op)
        index.apply(decode_batch(engine.payload()))
        expected = engine.reference()
        assert index.hashes() == expected
        added, gone = index.drain_delta()
        assert not set(added) & mirror and set(gone) <= mirror
        mirror = (mirror | set(added)) - set(gone)
        assert mirror == expected
    tokens = BASES[query[0]][: query[1]] + toks(20, query[2])
    chain = block_hashes(tokens, B, SEED)
    n = next((i for i, h in enumerate(chain) if h not in expected), len(chain))
    assert index.match(tokens) == n * B
    assert index.counters()["unknown_removals"] == 0


# ---------------------------------------------------------------------------------- units
def test_block_sizes_must_divide_one_another() -> None:
    for engine_bs in (1, 2, 4, 8, 16, 32, 64, 256):
        check_block_sizes(engine_bs, 16)
    for engine_bs in (12, 24, 5):
        with pytest.raises(EngineConfigError, match="divide"):
            check_block_sizes(engine_bs, 16)
    with pytest.raises(EngineConfigError):
        EngineIndex(16, SEED, engine_block_size=24)
    with pytest.raises(ValueError):
        EngineIndex(0, SEED)


def test_an_event_of_an_incompatible_block_size_is_refused_and_counted() -> None:
    index = EngineIndex(B, SEED)
    index.apply(stored([1], None, toks(24)))
    assert len(index) == 0 and index.counters()["rejected_block_size"] == 1
    assert index.config_error is not None and "24" in index.config_error
    pinned = EngineIndex(B, SEED, engine_block_size=16)
    pinned.apply(stored([1], None, toks(32)))
    assert len(pinned) == 0 and pinned.config_error is not None


def test_vllm_multi_block_event_indexes_each_block() -> None:
    t = toks(64)
    index = EngineIndex(B, SEED)
    index.apply(stored([10, 11, 12, 13], None, t))
    assert index.hashes() == set(block_hashes(t, B, SEED))
    assert index.match((*t, 1, 2, 3)) == 64 and index.match(t[:40]) == 32
    assert index.indexed_tokens == 64 and index.stored_tokens == 64


def test_larger_engine_blocks_hold_several_mesh_blocks() -> None:
    t = toks(128)
    index = EngineIndex(B, SEED)
    index.apply(stored([1], None, t[:64]))
    index.apply(stored([2], 1, t[64:]))
    assert index.hashes() == set(block_hashes(t, B, SEED)) and len(index) == 8


def test_small_pages_accumulate_into_a_mesh_block() -> None:
    t = toks(32)
    index = EngineIndex(B, SEED)
    for i in range(31):
        index.apply(stored([i], i - 1 if i else None, t[i : i + 1]))
    assert index.hashes() == {block_hashes(t, B, SEED)[0]}
    index.apply(stored([31], 30, t[31:]))
    assert index.hashes() == set(block_hashes(t, B, SEED))


def test_an_evicted_parent_hides_its_children_until_stored_again() -> None:
    t = toks(48)
    index = EngineIndex(B, SEED)
    index.apply(stored([1, 2, 3], None, t))
    index.drain_delta()
    h = block_hashes(t, B, SEED)
    index.apply(removed(2))
    assert index.hashes() == {h[0]}
    assert index.drain_delta() == ((), tuple(sorted(h[1:])))
    index.apply(stored([2], 1, t[16:32]))  # the engine recomputed block 2; block 3 is still held
    assert index.hashes() == set(h)
    assert index.drain_delta() == (tuple(sorted(h[1:])), ())


def test_offload_tiers_and_other_groups_are_skipped() -> None:
    t = toks(16)
    index = EngineIndex(B, SEED)
    index.apply(stored([1], None, t, medium="CPU"))
    index.apply(stored([2], None, t, group_idx=1))
    assert len(index) == 0
    index.apply(stored([3], None, t, medium="GPU"))
    index.apply(removed(3, medium="CPU"))
    index.apply(removed(3, group_idx=2))
    index.apply(KvBatch(0.0, (EngineAllCleared("CPU"),)))
    assert len(index) == 1
    c = index.counters()
    assert c["skipped_medium"] == 3 and c["skipped_group"] == 2 and c["clears"] == 0
    hybrid = EngineIndex(B, SEED, group_idx=1)
    hybrid.apply(stored([2], None, t, group_idx=1))
    assert len(hybrid) == 1


def test_lora_and_extra_key_blocks_are_opaque_with_everything_below() -> None:
    t = toks(48)
    index = EngineIndex(B, SEED)
    index.apply(stored([1], None, t[:16], lora_id=7))
    index.apply(stored([2], 1, t[16:32]))
    assert len(index) == 0
    index.apply(stored([5, 6, 7], None, t, keyed=(False, True, False)))
    assert index.hashes() == {block_hashes(t, B, SEED)[0]}
    index.apply(removed(1, 6))
    c = index.counters()
    assert c["opaque_blocks"] == 2 and c["unknown_removals"] == 0 and c["blocks_removed"] == 2


def test_unknown_events_and_unknown_removals_are_counted() -> None:
    index = EngineIndex(B, SEED)
    index.apply(KvBatch(0.0, (UnknownEngineEvent("BlockPinned"),)))
    index.apply(removed(99))
    c = index.counters()
    assert c["unknown_events"] == 1 and c["unknown_removals"] == 1 and c["events"] == 2
    assert c["batches"] == 2


def test_clear_and_drop_remove_everything_in_the_delta() -> None:
    t = toks(32)
    index = EngineIndex(B, SEED)
    index.apply(stored([1, 2], None, t))
    added, _ = index.drain_delta()
    index.apply(KvBatch(0.0, (EngineAllCleared(),)))
    assert len(index) == 0 and index.drain_delta() == ((), added)
    index.apply(stored([1, 2], None, t))
    index.drop()
    assert index.drain_delta() == ((), ())  # added and removed before a drain: no change
    c = index.counters()
    assert c["clears"] == 1 and c["drops"] == 1 and index.stored_tokens == 0


def test_duplicate_and_replaced_stores() -> None:
    a, b = toks(16, 1), toks(16, 2)
    index = EngineIndex(B, SEED)
    index.apply(stored([1], None, a))
    index.apply(stored([1], None, a))
    assert index.counters()["duplicate_stores"] == 1
    index.apply(stored([1], None, b))  # same engine hash, other tokens: the new one wins
    assert index.hashes() == set(block_hashes(b, B, SEED))
    assert index.counters()["replaced_stores"] == 1


def test_two_engine_blocks_naming_one_prefix_are_reference_counted() -> None:
    t = toks(16)
    index = EngineIndex(B, SEED)
    index.apply(stored([1], None, t))
    index.apply(stored([2], None, t))
    index.apply(removed(1))
    assert index.hashes() == set(block_hashes(t, B, SEED))
    index.apply(removed(2))
    assert len(index) == 0


def test_cycles_and_self_parents_index_nothing_and_terminate() -> None:
    t = toks(16)
    index = EngineIndex(B, SEED)
    index.apply(stored([1], 2, t))
    index.apply(stored([2], 1, t))
    index.apply(stored([3], 3, t))
    assert len(index) == 0
    index.apply(removed(1, 2, 3))
    assert index.stored_tokens == 0


def test_long_page_chains_do_not_recurse() -> None:
    t = toks(20_000)
    index = EngineIndex(B, SEED)
    index.apply(KvBatch(0.0, tuple(
        EngineBlockStored((i,), i - 1 if i else None, t[i : i + 1], 1) for i in range(1, 20_000)
    )))  # fmt: skip
    assert len(index) == 0  # page 0 is missing: nothing is rooted
    index.apply(stored([0], None, t[:1]))
    assert len(index) == 1250
    index.apply(removed(0))
    assert len(index) == 0


def test_the_store_is_bounded() -> None:
    index = EngineIndex(B, SEED, max_tokens=32)
    index.apply(stored([1, 2, 3], None, toks(48)))
    assert len(index) == 2 and index.counters()["over_capacity"] == 1


def test_the_store_is_bounded_in_blocks_too() -> None:
    """One-token blocks cost a block's bookkeeping each: the block count is bounded too."""
    index = EngineIndex(1, SEED, engine_block_size=1, max_blocks=3)
    index.apply(stored([1, 2, 3, 4, 5], None, toks(5)))
    assert index.counters()["over_capacity"] == 2 and index.counters()["blocks_stored"] == 3


# ---------------------------------------------------------- spec kinds, engine granularity
def test_blocks_of_groups_that_are_not_full_attention_are_skipped() -> None:
    index = EngineIndex(B, SEED)
    t = toks(2 * B)
    index.apply(stored([1, 2], None, t, spec_kind="sliding_window"))
    assert len(index) == 0 and index.counters()["skipped_kind"] == 2
    index.apply(stored([1, 2], None, t, spec_kind="full_attention"))
    assert index.match(t) == 2 * B


def test_reuse_block_size_is_the_engines_configured_or_seen_block_size() -> None:
    assert EngineIndex(B, SEED).reuse_block_size == 1  # unknown: no flooring
    assert EngineIndex(B, SEED, engine_block_size=8 * B).reuse_block_size == 8 * B
    index = EngineIndex(B, SEED)
    index.apply(stored([1], None, toks(4 * B)))
    assert index.observed_block_size == 4 * B and index.reuse_block_size == 4 * B


# ------------------------------------------------------------- real vLLM 0.32 (captured)
VLLM_FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_0_32"


def _prefixes(batches: list[KvBatch]) -> dict[Any, tuple[int, ...]]:
    """Reference: engine hash -> full token prefix, by following parents (removals drop)."""
    blocks: dict[Any, tuple[Any, tuple[int, ...]]] = {}
    for batch in batches:
        for ev in batch.events:
            if isinstance(ev, EngineBlockStored):
                parent = ev.parent_hash
                for i, h in enumerate(ev.block_hashes):
                    size = ev.block_size
                    blocks[h] = (parent, ev.token_ids[i * size:(i + 1) * size])
                    parent = h
            elif isinstance(ev, EngineBlockRemoved):
                for h in ev.block_hashes:
                    blocks.pop(h, None)
            elif isinstance(ev, EngineAllCleared):
                blocks.clear()
    out: dict[Any, tuple[int, ...]] = {}
    for h in blocks:
        chain: list[tuple[int, ...]] = []
        key: Any = h
        while key is not None and key in blocks:
            parent, tokens = blocks[key]
            chain.append(tokens)
            key = parent
        if key is None:  # rooted: every ancestor present
            out[h] = tuple(t for part in reversed(chain) for t in part)
    return out


@pytest.mark.parametrize("mesh_block", [16, 128])
def test_index_from_real_vllm_batches_equals_the_engines_rooted_blocks(mesh_block: int) -> None:
    frames = msgpack.unpackb((VLLM_FIXTURES / "live.msgpack").read_bytes(), raw=False)
    batches = [decode_batch(f[2]) for f in frames]
    index = EngineIndex(mesh_block, SEED, engine_block_size=128)
    for batch in batches:
        index.apply(batch)
    want = {h for prefix in _prefixes(batches).values()
            for h in block_hashes(prefix, mesh_block, SEED)}
    assert want and index.hashes() == frozenset(want)
    counts = index.counters()
    assert counts["rejected_block_size"] == counts["skipped_kind"] == 0
    assert counts["unknown_events"] == 0 and counts["blocks_removed"] > 0
    longest = max(_prefixes(batches).values(), key=len)
    assert index.match(longest) == len(longest)
