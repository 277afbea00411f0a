"""RadixTree against a naive model: the set of cached prefixes, per-prefix access times, locks.

Node values are ``Seg(start, path)``: the absolute position of the node's first token and the
whole token path up to the node's end, so a wrongly split value is caught exactly, and each
``Evicted`` tells the model which prefixes disappeared.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from radixmesh.core.blocks import block_hashes
from radixmesh.core.radix import RadixTree, TreeNode

SEED = 0x5EED


@dataclass(frozen=True)
class Seg:
    start: int
    path: tuple[int, ...]


def split_seg(value: Seg, at: int) -> tuple[Seg, Seg]:
    cut = value.start + at
    return Seg(value.start, value.path[:cut]), Seg(cut, value.path)


def walk(tree: RadixTree[Seg]) -> list[tuple[TreeNode[Seg], tuple[int, ...]]]:
    """Every non-root node with its full path."""
    out = []
    stack = [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            child_path = path + child.key
            out.append((child, child_path))
            stack.append((child, child_path))
    return out


def common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# Token lists that share long prefixes: a cut of one of a few base sequences plus a short tail.
BASES = (
    (0, 1, 2, 3, 0, 1, 2, 3, 1, 1, 2, 2, 3, 3, 0, 0, 1, 2, 3, 0),
    (0, 1, 2, 3, 0, 1, 3, 3, 3, 2, 1, 0, 0, 1, 2, 3, 2, 2, 1, 1),
    (2, 2, 2, 1, 1, 1, 0, 0, 0, 3, 3, 3, 2, 1, 2, 1, 0, 1, 0, 1),
)
tokens_st = st.builds(
    lambda base, cut, tail: base[:cut] + tuple(tail),
    st.sampled_from(BASES),
    st.integers(0, len(BASES[0])),
    st.lists(st.integers(0, 3), max_size=6),
)


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.prefixes: set[tuple[int, ...]] = set()  # every cached non-empty prefix
        self.access: dict[tuple[int, ...], float] = {}
        self.held: list[tuple[TreeNode[Seg], tuple[int, ...]]] = []  # (locked node, its path)
        self.now = 0.0
        self.mirror: set[int] = set()

    @initialize(block_size=st.sampled_from([1, 3, 4]))
    def setup(self, block_size: int) -> None:
        self.tree: RadixTree[Seg] = RadixTree(block_size, SEED, split_seg)

    def _tick(self) -> float:
        self.now += 1.0
        return self.now

    def _touch(self, tokens: tuple[int, ...], length: int, now: float) -> None:
        for i in range(1, length + 1):
            self.access[tokens[:i]] = now

    def model_match(self, tokens: tuple[int, ...]) -> int:
        n = 0
        while n < len(tokens) and tokens[: n + 1] in self.prefixes:
            n += 1
        return n

    # ------------------------------------------------------------------------------ rules
    @rule(tokens=tokens_st, give_hashes=st.booleans())
    def insert(self, tokens: tuple[int, ...], give_hashes: bool) -> None:
        now = self._tick()
        hashes = block_hashes(tokens, self.tree.block_size, SEED) if give_hashes else None

        def make(start: int, end: int) -> Seg:
            return Seg(start, tokens[:end])

        before = self.model_match(tokens)
        assert self.tree.insert(tokens, now, make, hashes) == before
        for i in range(1, len(tokens) + 1):
            self.prefixes.add(tokens[:i])
        self._touch(tokens, len(tokens), now)

    @rule(tokens=tokens_st)
    def match(self, tokens: tuple[int, ...]) -> None:
        assert self.tree.match(tokens) == self.model_match(tokens)

    @rule(tokens=tokens_st, lock=st.booleans())
    def match_prefix(self, tokens: tuple[int, ...], lock: bool) -> None:
        now = self._tick()
        result = self.tree.match_prefix(tokens, now)
        assert result.length == self.model_match(tokens)
        self._touch(tokens, result.length, now)
        # Values along the path chain up and end exactly at the match.
        pos = 0
        for value in result.values:
            assert value.start == pos
            pos = len(value.path)
        assert pos == result.length
        if result.values:
            assert result.values[-1].path == tokens[: result.length]
        assert result.node.end == result.length
        if lock:
            self.tree.lock(result.node)
            self.held.append((result.node, tokens[: result.length]))

    @rule(pick=st.integers(0, 7))
    def unlock(self, pick: int) -> None:
        if self.held:
            node, _ = self.held.pop(pick % len(self.held))
            self.tree.unlock(node)

    @rule(n_tokens=st.integers(0, 60))
    def evict(self, n_tokens: int) -> None:
        self._evict(n_tokens)

    @rule(budget=st.integers(0, 60))
    def evict_to_budget(self, budget: int) -> None:
        self._evict(max(0, self.tree.total_tokens - budget))
        assert self.tree.total_tokens <= budget or self.tree.evictable_tokens == 0

    def _evict(self, n_tokens: int) -> None:
        before_total = self.tree.total_tokens
        evicted = self.tree.evict(n_tokens)
        freed = sum(e.tokens for e in evicted)
        assert self.tree.total_tokens == before_total - freed
        assert freed >= n_tokens or self.tree.evictable_tokens == 0
        if evicted:  # no more than needed: the last leaf was required to reach n_tokens
            assert freed - evicted[-1].tokens < n_tokens
        for e in evicted:
            assert e.value is not None and e.value.start == e.start
            assert len(e.value.path) == e.start + e.tokens
            for i in range(e.start + 1, len(e.value.path) + 1):
                self.prefixes.remove(e.value.path[:i])
            # LRU: nothing evicted was touched after a leaf that stays evictable.
        for _, path in self.held:  # locked paths are never evicted
            assert self.tree.match(path) == len(path)
        if evicted:
            oldest_kept = min(
                (
                    node.last_access
                    for node, _ in walk(self.tree)
                    if node.is_leaf() and node.lock_ref == 0
                ),
                default=float("inf"),
            )
            assert max(self.access[e.value.path] for e in evicted if e.value) <= oldest_kept

    @rule()
    def drain(self) -> None:
        added, removed = self.tree.drain_delta()
        assert not set(added) & set(removed)
        self.mirror -= set(removed)
        self.mirror |= set(added)
        assert self.mirror == self.tree.block_hashes()

    # ------------------------------------------------------------------------- invariants
    @invariant()
    def structure_matches_model(self) -> None:
        nodes = walk(self.tree)
        tree_prefixes = {path[:i] for _, path in nodes for i in range(1, len(path) + 1)}
        assert tree_prefixes == self.prefixes
        total = locked = 0
        for node, path in nodes:
            assert node.key and node.end == len(path) and node.start == len(path) - len(node.key)
            assert node.value == Seg(node.start, path)
            assert node.last_access == self.access[path]
            expected_locks = sum(1 for _, q in self.held if q[: len(path)] == path)
            assert node.lock_ref == expected_locks
            total += len(node.key)
            locked += len(node.key) if node.lock_ref else 0
            for child in node.children.values():
                assert child.parent is node and node.last_access >= child.last_access
        assert self.tree.total_tokens == total
        assert self.tree.locked_tokens == locked
        assert self.tree.evictable_tokens == total - locked

    @invariant()
    def block_hashes_are_those_of_cached_prefixes(self) -> None:
        bs = self.tree.block_size
        expected: set[int] = set()
        for node, path in walk(self.tree):
            if node.is_leaf():
                expected.update(block_hashes(path, bs, SEED))
        assert self.tree.block_hashes() == expected
        node_hashes = [h for node, _ in walk(self.tree) for h in node.hashes]
        assert len(node_hashes) == len(expected)


RadixMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=100, deadline=None)
TestRadixModel = RadixMachine.TestCase


def test_lru_evicts_oldest_leaf_first() -> None:
    tree: RadixTree[None] = RadixTree(4, SEED)
    tree.insert([1, 2, 3, 4], now=1.0)
    tree.insert([1, 2, 9, 9], now=2.0)
    tree.insert([5, 5], now=3.0)
    tree.match_prefix([1, 2, 3, 4], now=4.0)  # [1,2,3,4] is now the most recent
    evicted = tree.evict(1)
    assert [(e.start, e.tokens) for e in evicted] == [(2, 2)]  # the [9, 9] leaf
    assert tree.match([1, 2, 9, 9]) == 2 and tree.match([5, 5]) == 2


def test_values_without_split_value_refuse_to_split() -> None:
    tree: RadixTree[str] = RadixTree(4, SEED)
    tree.insert([1, 2, 3], now=1.0, make_value=lambda s, e: "kv")
    with pytest.raises(RuntimeError):
        tree.match_prefix([1, 2], now=2.0)


def test_unlock_without_lock_raises() -> None:
    tree: RadixTree[None] = RadixTree(4, SEED)
    tree.insert([1, 2, 3], now=1.0)
    node = tree.match_prefix([1, 2, 3], now=2.0).node
    with pytest.raises(RuntimeError):
        tree.unlock(node)


def test_bad_block_size() -> None:
    with pytest.raises(ValueError):
        RadixTree(0, SEED)
