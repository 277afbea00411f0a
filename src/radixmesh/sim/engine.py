"""The simulated engine: the real radix tree of token ids, no tensors, times from a cost model.

Theory of operation
-------------------
It keeps exactly the bookkeeping the built-in engine keeps — a ``core.radix.RadixTree`` of
token ids with a token budget, least-recently-used leaf eviction and locks on the path of the
running request — so cache hits, evictions and the block hashes gossiped are the same as on a
real node fed the same requests. Only the arithmetic is replaced by a :class:`CostModel`.

One request at a time (the node runs a FIFO queue in front of it)::

    begin(tokens)  match_prefix(all but the last token) (touch LRU) -> lock the matched path
                   -> evict LRU leaves for the new tokens -> cached tokens and service time
    finish(run)    insert prompt + generated tokens but the last, truncated to the room left
                   -> unlock             (engine/radix_cache.py: acquire / commit)

``noise`` > 0 multiplies each request's time by a mean-1 log-normal factor, like a real node on
a busy machine (a calibration reports the relative scatter it saw). As in the built-in engine,
at least one prompt token is always computed (there must be logits
to sample from), so a fully cached prompt still reports ``len(prompt) - 1`` cached tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from radixmesh.core.radix import RadixTree, TreeNode
from radixmesh.sim.costs import CostModel


@dataclass(slots=True)
class Execution:
    """One request on the engine, between ``begin`` and ``finish``."""

    tokens: Sequence[int]
    hashes: Sequence[int]
    node: TreeNode[None]
    cached_tokens: int
    prefill_s: float
    decode_s: float
    service_s: float  # request overhead + prefill + decode


class SimEngine:
    def __init__(
        self,
        cost: CostModel,
        cache_tokens: int,
        block_size: int,
        seed: int,
        noise: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        if cache_tokens < 1:
            raise ValueError("cache_tokens must be >= 1")
        if noise < 0:
            raise ValueError("noise must be >= 0")
        self.cost = cost
        self.noise = noise  # sigma of a mean-1 log-normal factor on each request's time
        self._rng = rng or random.Random(0)
        self.cache_tokens = cache_tokens
        self.tree: RadixTree[None] = RadixTree(block_size, seed)
        self.evicted_tokens = 0

    # ----------------------------------------------------------------------------- queries
    def match(self, tokens: Sequence[int]) -> int:
        """Cached prefix length (read-only; what the node asks before routing)."""
        return self.tree.match(tokens)

    @property
    def total_tokens(self) -> int:
        return self.tree.total_tokens

    def drain_delta(self) -> tuple[list[int], list[int]]:
        return self.tree.drain_delta()

    # ----------------------------------------------------------------------------- serving
    def begin(
        self, tokens: Sequence[int], hashes: Sequence[int], max_tokens: int, now: float
    ) -> Execution:
        """Match (all but the last token), lock, and make room for the new tokens."""
        reserve = len(tokens) - self.tree.match(tokens) + max_tokens
        hit = self.tree.match_prefix(tokens[: max(len(tokens) - 1, 0)], now)
        self.tree.lock(hit.node)
        self._make_room(reserve)
        cached = hit.length
        factor = self._factor()
        prefill = self.cost.prefill_s(len(tokens) - cached, cached) * factor
        decode = self.cost.decode_s(max_tokens) * factor
        service = self.cost.request_overhead_s * factor + prefill + decode
        return Execution(tokens, hashes, hit.node, cached, prefill, decode, service)

    def finish(self, run: Execution, generated: Sequence[int], now: float) -> None:
        """Insert what was fed to the model (prompt + all generated tokens but the last),
        truncated to the room left, then unlock."""
        seq = list(run.tokens)
        seq.extend(generated[:-1])  # the last sampled token never went through the model
        try:
            have = self.tree.match(seq)
            end = min(len(seq), have + self._make_room(len(seq) - have))
            if end > have:
                hashes = run.hashes if end <= len(run.tokens) else None
                self.tree.insert(seq[:end], now, None, hashes)
        finally:
            self.tree.unlock(run.node)

    def _factor(self) -> float:
        """Run-time noise of a real machine (other processes, caches): a log-normal factor
        with mean 1, so the cost model stays the mean."""
        if self.noise <= 0:
            return 1.0
        s = self.noise
        return self._rng.lognormvariate(-s * s / 2, s)

    def _make_room(self, incoming: int) -> int:
        """Evict LRU leaves until ``incoming`` more tokens fit; returns the room left."""
        excess = self.tree.total_tokens + incoming - self.cache_tokens
        if excess > 0:
            for ev in self.tree.evict(excess):
                self.evicted_tokens += ev.tokens
        return max(self.cache_tokens - self.tree.total_tokens, 0)
