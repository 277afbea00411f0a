"""PrefixCache against a reference model: the set of cached token prefixes under a token budget.

The model is the set of every cached non-empty prefix (so its size is the token count), each
prefix's last access time, and the prefixes locked by live leases. The tree evicts whole nodes
whose boundaries depend on history, so the model does not predict *which* leaves go; it checks
that what went was legal: only unlocked prefixes, none while the budget had room, and least
recently used first (every evicted prefix was accessed no later than any unlocked survivor).
Everything else is predicted exactly: matches, lease lengths and values, the truncated insert,
the budget, usage and the block-hash journal (the drained delta is exactly the set difference
of the cached block hashes since the previous drain, with no duplicates).
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixmesh.core.blocks import block_hashes
from radixmesh.core.prefix_cache import Lease, PrefixCache
from radixmesh.core.radix import RadixTree

SEED = 0x5EED
Prefix = tuple[int, ...]


@dataclass(frozen=True)
class Seg:
    """A node's value: its first absolute position and its tokens (checked on every lease)."""

    start: int
    tokens: Prefix


def split_seg(value: Seg, at: int) -> tuple[Seg, Seg]:
    return Seg(value.start, value.tokens[:at]), Seg(value.start + at, value.tokens[at:])


def cached_prefixes(tree: RadixTree[Seg]) -> set[Prefix]:
    out: set[Prefix] = set()
    stack: list[tuple[object, Prefix]] = [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():  # type: ignore[attr-defined]
            for i in range(1, len(child.key) + 1):
                out.add(path + child.key[:i])
            stack.append((child, path + child.key))
    return out


BASES = (
    (0, 1, 2, 3, 0, 1, 2, 3, 1, 1, 2, 2, 3, 3, 0, 0),
    (0, 1, 2, 3, 0, 1, 3, 3, 3, 2, 1, 0, 0, 1, 2, 3),
    (2, 2, 2, 1, 1, 1, 0, 0, 0, 3, 3, 3, 2, 1, 2, 1),
)
tokens_st = st.builds(
    lambda base, cut, tail: base[:cut] + tuple(tail),
    st.sampled_from(BASES),
    st.integers(0, len(BASES[0])),
    st.lists(st.integers(0, 3), max_size=5),
)
prompt_st = tokens_st.filter(bool)


@dataclass
class Held:
    lease: Lease[Seg]
    prompt: Prefix


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cached: set[Prefix] = set()
        self.access: dict[Prefix, float] = {}
        self.held: list[Held] = []
        self.drained: set[int] = set()  # block hashes cached at the previous drain
        self.now = 0.0
        self._hash_memo: dict[Prefix, int] = {}

    @initialize(budget=st.integers(0, 40), block_size=st.sampled_from([1, 3, 4]))
    def setup(self, budget: int, block_size: int) -> None:
        self.budget, self.bs = budget, block_size
        self.cache: PrefixCache[Seg] = PrefixCache(budget, block_size, SEED, split_seg)

    # ------------------------------------------------------------------------- the model
    def _tick(self) -> float:
        self.now += 1.0
        return self.now

    def model_match(self, tokens: Prefix) -> int:
        n = 0
        while n < len(tokens) and tokens[: n + 1] in self.cached:
            n += 1
        return n

    def locked(self) -> set[Prefix]:
        return {h.prompt[:i] for h in self.held for i in range(1, h.lease.cached + 1)}

    def model_hashes(self) -> set[int]:
        return {self._block_hash(p) for p in self.cached if len(p) % self.bs == 0}

    def _block_hash(self, prefix: Prefix) -> int:
        if prefix not in self._hash_memo:
            self._hash_memo[prefix] = block_hashes(prefix, self.bs, SEED)[-1]
        return self._hash_memo[prefix]

    def _touch(self, tokens: Prefix, length: int, now: float) -> None:
        for i in range(1, length + 1):
            self.access[tokens[:i]] = now

    def _observe(self, locked: set[Prefix], room_needed: int | None) -> set[Prefix]:
        """The tree's prefixes now; checks what left was a legal LRU eviction. Returns them."""
        after = cached_prefixes(self.cache.tree)
        gone = self.cached - after
        if gone:
            assert not gone & locked, "a locked prefix was evicted"
            if room_needed is not None:
                assert len(self.cached) + room_needed > self.budget, "evicted with room left"
            survivors = [self.access[p] for p in self.cached & after if p not in locked]
            if survivors:
                assert max(self.access[p] for p in gone) <= min(survivors), "not LRU"
        return after

    # ------------------------------------------------------------------------- rules
    @rule(prompt=prompt_st, max_new=st.integers(0, 4))
    def acquire(self, prompt: Prefix, max_new: int) -> None:
        now = self._tick()
        reserve = self.cache.reserve_for(prompt, max_new)
        assert reserve == len(prompt) - self.model_match(prompt) + max_new
        expect = self.model_match(prompt[:-1])
        lease = self.cache.acquire(prompt, reserve, now)
        assert lease.cached == expect and lease.active
        values = [t for v in lease.values for t in v.tokens]
        assert tuple(values) == prompt[:expect]
        assert [v.start for v in lease.values] == sorted(v.start for v in lease.values)
        self._touch(prompt, expect, now)
        self.held.append(Held(lease, prompt))
        after = self._observe(self.locked(), reserve)
        assert len(after) + reserve <= self.budget or self.cache.usage().locked_tokens == len(after)
        self.cached = after

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), max_size=4), cover=st.integers(0, 30))
    def commit(self, data: st.DataObject, extra: list[int], cover: int) -> None:
        held = self.held[data.draw(st.integers(0, len(self.held) - 1))]
        tokens = held.prompt + tuple(extra)
        hashes = block_hashes(tokens[:cover], self.bs, SEED)  # any prefix's chain may be given
        now = self._tick()

        def make(start: int, stop: int) -> Seg:
            return Seg(start, tokens[start:stop])

        # The lease still holds its path while room is made, and the insert protects (and
        # touches) the cached prefix of ``tokens`` it extends.
        have = self.model_match(tokens)
        locked = self.locked() | {tokens[:i] for i in range(1, have + 1)}
        added = self.cache.commit(held.lease, tokens, now, make, hashes)
        self.held.remove(held)
        assert not held.lease.active
        self._touch(tokens, have, now)
        after = self._observe(locked, None)
        end = max((len(p) for p in after if p == tokens[: len(p)]), default=0)
        assert after - self.cached <= {tokens[:i] for i in range(1, end + 1)}
        assert end == len(tokens) or len(after) == self.budget, "truncated with room left"
        if added:
            self._touch(tokens, end, now)
        assert len(after - self.cached) <= added <= len(tokens)
        self.cached = after

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        held = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.cache.release(held.lease)
        self.cache.release(held.lease)  # a second end is a no-op
        assert not held.lease.active

    @rule(tokens=tokens_st)
    def match(self, tokens: Prefix) -> None:
        assert self.cache.match(tokens) == self.model_match(tokens)
        assert self.cache.reusable(tokens) == min(self.model_match(tokens), max(len(tokens) - 1, 0))

    @rule()
    def drain(self) -> None:
        added, removed = self.cache.drain_delta()
        now = self.model_hashes()
        assert len(added) == len(set(added)) and len(removed) == len(set(removed))
        assert set(added) == now - self.drained
        assert set(removed) == self.drained - now
        self.drained = now

    @rule()
    def clear(self) -> None:
        locked = self.locked()
        freed = self.cache.clear()
        after = cached_prefixes(self.cache.tree)
        assert after == self.cached & locked
        assert freed == len(self.cached) - len(after)
        self.cached = after

    # ------------------------------------------------------------------------- invariants
    @invariant()
    def budget_usage_and_index(self) -> None:
        if not hasattr(self, "cache"):
            return
        usage = self.cache.usage()
        assert usage.tokens == self.cache.total_tokens == len(self.cached) <= self.budget
        assert usage.budget == self.budget
        locked = self.locked()
        assert locked <= self.cached
        assert usage.locked_tokens == len(locked)
        assert self.cache.block_hashes() == self.model_hashes()


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)


def test_negative_budget_rejected() -> None:
    with pytest.raises(ValueError):
        PrefixCache(-1, 4, SEED)


def test_commit_keeps_its_own_cached_tail() -> None:
    """The unlocked cached tail of a leased prompt is what its commit extends: making room
    evicts other entries (even more recently used ones) rather than that tail, and the insert
    stays within budget."""
    cache: PrefixCache[None] = PrefixCache(10, 4, SEED)
    a = (1, 2, 3, 4, 5, 6)
    cache.commit(cache.acquire(a, 6, 1.0), a, 1.0)
    other = (9, 9, 9, 9)
    cache.commit(cache.acquire(other, 4, 2.0), other, 2.0)  # 10 cached: a (older) + other
    lease = cache.acquire(a, 0, 3.0)  # locks a[:5]; a's last token stays an unlocked leaf
    assert lease.cached == 5
    cache.commit(cache.acquire(other, 0, 4.0), other, 4.0)  # touch other: a[5:] is LRU now
    cache.commit(lease, (*a, 7), 5.0)  # needs 1 token: a's tail stays, ``other``'s last goes
    assert cache.match((*a, 7)) == 7
    assert cache.match(other) == 3  # its acquire split it at 3: the 1-token leaf was evicted
    assert cache.total_tokens <= 10
