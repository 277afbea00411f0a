"""The simulated engine: the shared prefix cache of token ids, no tensors, times from a cost model.

Theory of operation
-------------------
Cache management is ``core.prefix_cache.PrefixCache`` — the very code the built-in engine runs
(token budget, least-recently-used leaf eviction, locks on the path of the running request,
block-hash journal), here with no values — so cache hits, evictions and the block hashes
gossiped are the same as on a real node fed the same requests. Only the model is replaced: by a
:class:`CostModel` that says how long the request takes.

One request at a time (the node runs a FIFO queue in front of it)::

    begin(tokens)  cache.acquire: match all but the last token (touch LRU), lock that path,
                   evict LRU leaves for the new tokens -> a SimRun: cached tokens, times
    finish(run)    cache.commit: insert prompt + generated tokens but the last, truncated to
                   the room left -> unlock

A :class:`SimRun` holds its lease from ``begin`` until ``finish``; call ``finish`` exactly once.

``noise`` > 0 multiplies each request's time by a mean-1 log-normal factor, like a real node on
a busy machine (a calibration reports the relative scatter it saw). As in the built-in engine,
at least one prompt token is always computed (there must be logits
to sample from), so a fully cached prompt still reports ``len(prompt) - 1`` cached tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from radixmesh.core.prefix_cache import Lease, PrefixCache
from radixmesh.sim.costs import CostModel


@dataclass(slots=True)
class SimRun:
    """One simulated request on the engine, between ``begin`` and ``finish``."""

    tokens: Sequence[int]
    hashes: Sequence[int]
    lease: Lease[None]
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
        self.cache: PrefixCache[None] = PrefixCache(cache_tokens, block_size, seed)

    # ----------------------------------------------------------------------------- queries
    def match(self, tokens: Sequence[int]) -> int:
        """Cached prefix length (read-only; what the node asks before routing)."""
        return self.cache.match(tokens)

    @property
    def total_tokens(self) -> int:
        return self.cache.total_tokens

    @property
    def evicted_tokens(self) -> int:
        return self.cache.evicted_tokens

    def drain_delta(self) -> tuple[list[int], list[int]]:
        return self.cache.drain_delta()

    # ----------------------------------------------------------------------------- serving
    def begin(
        self, tokens: Sequence[int], hashes: Sequence[int], max_tokens: int, now: float
    ) -> SimRun:
        """Match (all but the last token), lock, and make room for the new tokens."""
        lease = self.cache.acquire(tokens, self.cache.reserve_for(tokens, max_tokens), now)
        cached = lease.cached
        factor = self._factor()
        prefill = self.cost.prefill_s(len(tokens) - cached, cached) * factor
        decode = self.cost.decode_s(max_tokens) * factor
        service = self.cost.request_overhead_s * factor + prefill + decode
        return SimRun(tokens, hashes, lease, cached, prefill, decode, service)

    def finish(self, run: SimRun, generated: Sequence[int], now: float) -> None:
        """Insert what was fed to the model (prompt + all generated tokens but the last),
        truncated to the room left, then unlock."""
        seq = list(run.tokens)
        seq.extend(generated[:-1])  # the last sampled token never went through the model
        self.cache.commit(run.lease, seq, now, None, run.hashes)

    def _factor(self) -> float:
        """Run-time noise of a real machine (other processes, caches): a log-normal factor
        with mean 1, so the cost model stays the mean."""
        if self.noise <= 0:
            return 1.0
        s = self.noise
        return self._rng.lognormvariate(-s * s / 2, s)
