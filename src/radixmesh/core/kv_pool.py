"""One KV block pool shared by the prefix cache and the running sequences' own KV.

Theory of operation
-------------------
An engine has one pool of ``kv_blocks`` KV blocks of ``block_size`` tokens. Part of it holds the
prefix cache (``core/prefix_cache.PrefixCache[None]``: a radix tree of token ids, LRU-evicted),
the rest holds what running sequences computed beyond the cached prefix they share::

    used_blocks = ceil(cache.total_tokens / block_size) + private_blocks <= kv_blocks

A running sequence holding ``kv`` KV tokens of which its first ``cached`` are a cached prefix
(locked in the tree by a lease, so never evicted under it) owns
``ceil((kv - cached) / block_size)`` private blocks; ``cached`` is always a whole number of
blocks, as in vLLM, which reuses full blocks only (vllm/v1/core/kv_cache_manager.py,
``get_computed_blocks``), and at least one prompt token is always computed (there must be logits
to sample from).

The cache's token budget is kept at ``(kv_blocks - private_blocks) * block_size``, so the cache's
own inserts (truncated to the room left, evicting LRU unlocked leaves) can never push the pool
over. A sequence grows by ``grow``: from free blocks, else by evicting unlocked cache entries —
first sparing the cached prefixes of the given token sequences (what queued requests will
reuse), then not — and fails (the scheduler then preempts) when locked entries and other
sequences' blocks leave too little. Moving a sequence's computed prompt into the cache
(``publish``) and committing a finished one (``release(..., commit=...)``) first return its
private blocks, so they need no eviction: the cache gains at most the tokens they covered.

``vllm=True`` follows vLLM 0.32's block pool instead (vllm/v1/core/block_pool.py): the cache
holds one block per distinct block hash (prompts that part inside a block hold one copy of that
block each, which the token count above misses: it counts their shared first tokens once),
eviction spares nothing (vLLM's free queue knows no queued requests) and takes whole blocks
from the tail of the least recently used leaf (``RadixTree.evict_blocks``), not whole leaves.

Not thread-safe, no clock: ``now`` (any monotonic float) orders the cache's LRU.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixmesh.core.prefix_cache import Lease, PrefixCache


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KvPool:
    """The block pool: a ``PrefixCache[None]`` plus the running sequences' private blocks."""

    def __init__(self, kv_blocks: int, block_size: int, seed: int, vllm: bool = False) -> None:
        self.kv_blocks = kv_blocks
        self.block_size = block_size
        self.cache: PrefixCache[None] = PrefixCache(kv_blocks * block_size, block_size, seed)
        self.vllm = vllm  # count and evict blocks as vLLM does (the module docstring)
        self.private_blocks = 0

    # ------------------------------------------------------------------------- read-only
    @property
    def cache_blocks(self) -> int:
        if self.vllm:
            return self.cache.tree.cached_blocks
        return _ceil_div(self.cache.total_tokens, self.block_size)

    @property
    def used_blocks(self) -> int:
        return self.cache_blocks + self.private_blocks

    @property
    def free_blocks(self) -> int:
        return self.kv_blocks - self.used_blocks

    @property
    def locked_blocks(self) -> int:
        """Cache blocks no eviction can free (running sequences' cached prefixes)."""
        if self.vllm:
            return self.cache.tree.locked_blocks
        return _ceil_div(self.cache.tree.locked_tokens, self.block_size)

    @property
    def held_blocks(self) -> int:
        """Blocks running sequences need: their private blocks and the cached prefixes they
        lock (vLLM's ``kv_cache_usage`` counts these; unlocked cached blocks count as free)."""
        return self.locked_blocks + self.private_blocks

    @property
    def room(self) -> int:
        """Blocks ``grow`` could take now, evicting every unlocked cache entry (vLLM's count of
        free blocks: its free queue holds unreferenced cached blocks too)."""
        return self.kv_blocks - self.private_blocks - self.locked_blocks

    def blocks_for(self, kv_tokens: int, cached: int) -> int:
        """Private blocks of a sequence with ``kv_tokens`` KV tokens, ``cached`` shared."""
        return _ceil_div(kv_tokens - cached, self.block_size)

    def reusable(self, tokens: Sequence[int]) -> int:
        """Tokens of ``tokens`` a sequence admitted now would reuse: whole cached blocks, and
        never the last token."""
        hit = min(self.cache.match(tokens), len(tokens) - 1)
        return max(hit, 0) // self.block_size * self.block_size

    # ------------------------------------------------------------------------- changes
    def lock(self, tokens: Sequence[int], now: float) -> Lease[None]:
        """Lock (and touch) the reusable prefix of ``tokens``; ``lease.cached`` is its length."""
        return self.cache.lock(tokens[: self.reusable(tokens)], now)

    def grow(self, n_blocks: int, spare: Sequence[Sequence[int]]) -> bool:
        """Take ``n_blocks`` more private blocks, evicting cache entries as needed (those that
        ``spare`` would reuse last); False, with nothing taken, if they cannot be had."""
        if n_blocks > self.free_blocks:
            if n_blocks > self.room:
                return False  # not even evicting every unlocked entry would do (vLLM: no evict)
            self._evict(n_blocks, spare)
            if n_blocks > self.free_blocks:
                return False
        self._set_private(self.private_blocks + n_blocks)
        return True

    def shrink(self, n_blocks: int) -> None:
        self._set_private(self.private_blocks - n_blocks)

    def publish(
        self, lease: Lease[None], tokens: Sequence[int], private: int, now: float
    ) -> Lease[None]:
        """Insert the whole blocks of ``tokens`` (a sequence's computed KV, whose ``private``
        blocks are returned first) into the cache and lock them for it instead of ``lease``."""
        self.shrink(private)
        full = len(tokens) // self.block_size * self.block_size
        self.cache.commit(lease, tokens[:full], now)
        found = self.cache.match(tokens[:full]) // self.block_size * self.block_size
        return self.cache.lock(tokens[:found], now)

    def release(
        self, lease: Lease[None], private: int, commit: Sequence[int] | None, now: float
    ) -> None:
        """A sequence leaves: return its ``private`` blocks, end its lease, and insert the whole
        blocks of ``commit`` (if given) into the cache."""
        self.shrink(private)
        if commit is None:
            self.cache.release(lease)
            return
        full = len(commit) // self.block_size * self.block_size
        self.cache.commit(lease, commit[:full], now)

    # ------------------------------------------------------------------------- helpers
    def _set_private(self, blocks: int) -> None:
        if not 0 <= blocks <= self.kv_blocks:
            raise RuntimeError(f"private KV blocks out of range: {blocks}")
        self.private_blocks = blocks
        self.cache.budget = (self.kv_blocks - blocks) * self.block_size

    def _evict(self, n_blocks: int, spare: Sequence[Sequence[int]]) -> None:
        if self.vllm:
            self.cache.evict_blocks(n_blocks - self.free_blocks)
            return
        # Freeing tokens frees whole blocks only once the cache's token count drops past a block
        # boundary: aim at a token count whose block count leaves ``n_blocks`` free.
        for sparing in (spare, ()):
            short = n_blocks - self.free_blocks
            if short <= 0:
                return
            target = max(self.cache_blocks - short, 0) * self.block_size
            self.cache.evict(self.cache.total_tokens - target, sparing)
