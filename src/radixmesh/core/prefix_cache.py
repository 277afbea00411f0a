"""The budgeted prefix cache: one radix tree of token ids, a token budget, LRU eviction, leases.

Theory of operation
-------------------
This is the one cache-management implementation; every engine's scheduler
(``core/kv_pool.py``: values = nothing; the built-in engine keeps its KV blocks beside it,
``engine/paged_kv.py``) and the simulator (``sim/engine.py``) are built on it, so a simulated
node caches, evicts and gossips exactly what a real node fed the same requests would. A value is
opaque here: it covers exactly its node's token positions, and when an insert or a serving match
ends inside a node the tree splits the value with the ``split_value`` function given at
construction (required as soon as values are stored).

Lease lifecycle of one request (the paper's Algorithm 1, lines 7-13)::

    reserve = cache.reserve_for(prompt, max_new)    # tokens the request will add at most
    lease = cache.acquire(prompt, reserve, now)     # match prompt[:-1] (touches LRU, may
                                                    # split), lock that path, evict LRU
                                                    # unlocked leaves so ``reserve`` fits
    ... the model runs on lease.values (the cached prefix, lease.cached tokens) ...
    cache.commit(lease, fed, now, make_value)       # insert what went through the model,
                                                    # truncated to the room left; unlock
    (or cache.release(lease) when nothing is to be inserted)

At least one prompt token is always left uncached by ``acquire`` (a model needs logits to
sample from), so ``lease.cached <= len(prompt) - 1``; ``reusable`` is the read-only count of
the same thing, for routing.

What stays valid when
    * a :class:`Lease` is live from ``acquire`` to its ``commit`` or ``release`` (either ends
      it; a second end is a no-op). While live, its path is locked: never evicted, so
      ``lease.values`` (the values on the path at acquire time) stay readable — a later split
      of a locked node replaces the node's value by the two halves but never mutates the old
      one, which the lease still holds;
    * ``lease.node`` is the tree's own node; it may become the lower half of a later split
      (the lock follows it) and must not be used after the lease ends;
    * lists returned by ``drain_delta`` and the ``frozenset`` of ``block_hashes`` are the
      caller's.

Budget: ``total_tokens <= budget`` after every call. Eviction frees unlocked leaves least
recently used first (a parent that becomes a leaf becomes evictable in its turn), never the
cached prefix of what is being inserted; if locked paths leave too little room an insert is
truncated to what fits, so the cache holds a shorter prefix — correct, merely less useful.
The budget bounds the cache, not a running request's own working memory.

Block hashes: the tree keeps the set of chained block hashes of every cached full block and a
journal of additions and removals; ``drain_delta`` returns them (net) since the previous drain
— what the gossip layer sends.

Not thread-safe and no clock of its own: callers serialize access (the engine wraps it in a
mutex) and pass ``now`` (any monotonic float: wall time or a counter) for LRU order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from radixmesh.core.radix import MakeValue, RadixTree, SplitValue, TreeNode

V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class CacheUsage:
    tokens: int  # tokens currently cached
    budget: int  # capacity in tokens
    locked_tokens: int  # tokens pinned by running requests


@dataclass(slots=True)
class Lease(Generic[V]):
    """A running request's hold on its matched path; live until ``commit`` or ``release``."""

    cached: int  # prompt tokens whose values are reused
    node: TreeNode[V]  # end of the locked path (the tree's node: do not keep past the lease)
    values: list[V] = field(default_factory=list)  # the path's values, root first
    active: bool = True


class PrefixCache(Generic[V]):
    """Radix tree of token ids under a token budget. Mutates only in ``acquire``, ``lock``,
    ``commit``, ``release``, ``evict``, ``clear`` (tree, LRU, budget) and ``drain_delta``
    (the journal). ``budget`` may be lowered by an owner that first made the room
    (``core/kv_pool.py``)."""

    def __init__(
        self,
        budget_tokens: int,
        block_size: int,
        seed: int,
        split_value: SplitValue[V] | None = None,
    ) -> None:
        if budget_tokens < 0:
            raise ValueError("cache budget must be >= 0 tokens")
        self.budget = budget_tokens
        self.tree: RadixTree[V] = RadixTree(block_size, seed, split_value)  # read it, only
        self.evicted_tokens = 0  # lifetime counter

    # ------------------------------------------------------------------------- read-only
    @property
    def total_tokens(self) -> int:
        return self.tree.total_tokens

    def match(self, tokens: Sequence[int]) -> int:
        """Length of the longest cached prefix of ``tokens``; no split, no LRU touch."""
        return self.tree.match(tokens)

    def reusable(self, prompt: Sequence[int]) -> int:
        """Prompt tokens a request would reuse: ``match`` less the always-computed last one."""
        return min(self.tree.match(prompt), max(len(prompt) - 1, 0))

    def reserve_for(self, prompt: Sequence[int], max_new: int) -> int:
        """The most tokens a request on ``prompt`` generating ``max_new`` adds to the cache."""
        return len(prompt) - self.tree.match(prompt) + max_new

    def usage(self) -> CacheUsage:
        return CacheUsage(self.tree.total_tokens, self.budget, self.tree.locked_tokens)

    def block_hashes(self) -> frozenset[int]:
        """Every block hash currently cached."""
        return self.tree.block_hashes()

    def drain_delta(self) -> tuple[list[int], list[int]]:
        """Block hashes (added, removed) since the previous call, net of each other."""
        return self.tree.drain_delta()

    # ------------------------------------------------------------------------- leases
    def acquire(self, prompt: Sequence[int], reserve: int, now: float) -> Lease[V]:
        """Match and lock the cached prefix of ``prompt[:-1]``, then evict LRU unlocked leaves
        until ``reserve`` more tokens fit (as far as unlocked entries allow)."""
        found = self.tree.match_prefix(prompt[: max(len(prompt) - 1, 0)], now)
        self.tree.lock(found.node)
        self._make_room(reserve)
        return Lease(found.length, found.node, list(found.values))

    def lock(self, tokens: Sequence[int], now: float) -> Lease[V]:
        """Match (touching LRU, splitting at the end) and lock the cached prefix of all of
        ``tokens``, evicting nothing: a lease for an owner that makes room itself."""
        found = self.tree.match_prefix(tokens, now)
        self.tree.lock(found.node)
        return Lease(found.length, found.node, list(found.values))

    def commit(
        self,
        lease: Lease[V],
        tokens: Sequence[int],
        now: float,
        make_value: MakeValue[V] | None = None,
        hashes: Sequence[int] | None = None,
    ) -> int:
        """Insert ``tokens`` (truncated to the room left), end the lease; returns #added.

        New nodes covering positions ``[s, e)`` get ``make_value(s, e)``. ``hashes``, if given,
        are the chained block hashes of some prefix of ``tokens``: used when they cover the
        inserted part, recomputed otherwise.
        """
        try:
            return self._insert(tokens, now, make_value, hashes)
        finally:
            self.release(lease)

    def release(self, lease: Lease[V]) -> None:
        """End the lease without inserting (a no-op on an ended lease)."""
        if lease.active:
            lease.active = False
            self.tree.unlock(lease.node)

    def evict(self, n_tokens: int, spare: Sequence[Sequence[int]] = ()) -> int:
        """Evict up to ``n_tokens`` of unlocked entries, least recently used first, sparing the
        cached prefixes of the ``spare`` token sequences (locked meanwhile, not touched: LRU
        order is unchanged); returns tokens freed. A caller sharing one memory pool between
        this cache and other users (``core/kv_pool.py``) uses it to make room."""
        if n_tokens <= 0:
            return 0
        pinned = [self.tree.match_node(tokens) for tokens in spare]
        for node in pinned:
            self.tree.lock(node)
        try:
            return self._evict(n_tokens)
        finally:
            for node in pinned:
                self.tree.unlock(node)

    def evict_blocks(self, n_blocks: int) -> int:
        """Evict at least ``n_blocks`` whole blocks of unlocked entries, block by block
        (``RadixTree.evict_blocks``: vLLM's order); returns blocks freed."""
        evicted = self.tree.evict_blocks(n_blocks)
        self.evicted_tokens += sum(ev.tokens for ev in evicted)
        return sum(len(ev.hashes) for ev in evicted)

    def clear(self) -> int:
        """Evict every unlocked entry (removals are journaled); returns tokens freed."""
        return self._evict(self.tree.total_tokens)

    # ------------------------------------------------------------------------- helpers
    def _evict(self, n_tokens: int) -> int:
        freed = sum(ev.tokens for ev in self.tree.evict(n_tokens))
        self.evicted_tokens += freed
        return freed

    def _make_room(self, n_tokens: int) -> int:
        """Evict until ``n_tokens`` more fit; returns the room left."""
        need = self.tree.total_tokens + n_tokens - self.budget
        if need > 0:
            self._evict(need)
        return max(self.budget - self.tree.total_tokens, 0)

    def _insert(
        self,
        tokens: Sequence[int],
        now: float,
        make_value: MakeValue[V] | None,
        hashes: Sequence[int] | None,
    ) -> int:
        # The cached prefix of ``tokens`` is what this insert extends: touch and lock it while
        # room is made, so eviction takes other entries rather than evicting it and inserting
        # it again (the lease locks only ``prompt[:-1]``'s match, taken before the run).
        found = self.tree.match_prefix(tokens, now)
        have = found.length
        self.tree.lock(found.node)
        try:
            room = self._make_room(len(tokens) - have)
        finally:
            self.tree.unlock(found.node)
        end = min(len(tokens), have + room)
        if end <= have:
            return 0
        if hashes is not None and len(hashes) < end // self.tree.block_size:
            hashes = None
        self.tree.insert(tokens[:end], now, make_value, hashes)
        return end - have
