"""The ``oracle`` baseline: exact, instantaneous knowledge of every node's cache, same cost model.

Design (client-side, so no node needs a special mode):

* Nodes run policy ``none`` (they never route). The benchmark client keeps a *mirror* of each
  node's radix KV cache: the engine's own :class:`~radixmesh.engine.radix_cache.RadixKVCache`
  bookkeeping with 1-float placeholder tensors, fed the same token sequences, in the same order,
  with the same budget and the same LRU/eviction code. Under the paper's sequential schedule the
  mirror is exact (every record checks it: oracle ``expected_cached_tokens`` vs the node's
  ``cached_tokens``; mismatches are counted in the summary). It is what an infinitely fast,
  free gossip would give: the bound on what better gossip could buy.
* For each request the oracle ranks nodes with the *same* :class:`~radixmesh.core.router.Router`
  under policy ``cost``, with exact cached-token counts, the exact number of requests the client
  has in flight at each node, the known round-trip of a forward (2 × the emulated one-way delay
  + 1 ms of HTTP), and a per-node :class:`~radixmesh.core.estimators.ComputeModel` learnt from the
  latencies the client observed.
* The client sends the request to its entry node with ``x-radixmesh-target: <chosen node>``;
  the entry node forwards it through the real peer path (emulated delay both ways, HTTP, the
  same fallback rules), so a forward costs exactly what it costs any policy. The decision
  itself (a few µs in the client) is free — that is the "instantaneous knowledge".

Limitations (stated in the report): generated tokens are not mirrored for ``max_tokens > 1``
(MMLU uses 1, whose KV is never computed); under concurrency, commit order can differ from the
client's completion order, so the mirror may drift slightly (mismatches are counted).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from radixmesh.core.estimators import ComputeModel, CostPriors
from radixmesh.core.router import NodeInfo, Policy, RouteInput, Router, RouterConfig
from radixmesh.engine.radix_cache import LayerKV, RadixKVCache

HTTP_OVERHEAD_S = 0.001


class CacheMirror:
    """Bookkeeping replica of one node's radix KV cache (placeholder tensors)."""

    def __init__(self, budget_tokens: int, block_size: int) -> None:
        self.cache = RadixKVCache(budget_tokens, block_size, seed=0)
        self._clock = 0.0

    def match(self, prompt: Sequence[int]) -> int:
        """Tokens the node would reuse (the engine keeps >= 1 token uncached)."""
        return min(self.cache.match(prompt), max(len(prompt) - 1, 0))

    def serve(self, prompt: Sequence[int], max_tokens: int) -> int:
        """Replay ``generate``'s cache steps for a request; returns the cached tokens."""
        self._clock += 1.0
        reserve = len(prompt) - self.cache.match(prompt) + max_tokens
        lease = self.cache.acquire(prompt, reserve, self._clock)
        fake = torch.zeros(1, 1, len(prompt), 1)
        kv: LayerKV = [(fake, fake)]
        self.cache.commit(lease, list(prompt), kv, self._clock)
        return lease.cached


class Oracle:
    """Chooses the serving node for each request from exact cache state."""

    def __init__(
        self,
        node_ids: Sequence[str],
        budget_tokens: int,
        block_size: int,
        comm_delay_s: float,
        seed: int,
    ) -> None:
        self.node_ids = list(node_ids)
        self.mirrors = [CacheMirror(budget_tokens, block_size) for _ in node_ids]
        self.rtt_s = 2 * comm_delay_s + HTTP_OVERHEAD_S
        priors = CostPriors(rtt_s=self.rtt_s)
        self.models = [ComputeModel(priors) for _ in node_ids]
        self.inflight = [0 for _ in node_ids]
        self.router = Router(RouterConfig(policy=Policy.COST))
        self.rng = random.Random(seed)
        self.mismatches = 0

    def choose(self, prompt: Sequence[int], max_tokens: int, entry: int) -> tuple[int, int]:
        """(node index, predicted cached tokens) for a request entering at ``entry``."""
        infos = [
            NodeInfo(
                node_id=nid,
                is_self=i == entry,
                cached_tokens=self.mirrors[i].match(prompt),
                rtt_s=0.0 if i == entry else self.rtt_s,
                queue_depth=self.inflight[i],
                speed=self.models[i].report(),
            )
            for i, nid in enumerate(self.node_ids)
        ]
        head = self.router.rank(RouteInput(len(prompt), max_tokens), infos, self.rng)[0]
        return self.node_ids.index(head.node_id), head.expected_cached_tokens

    def started(self, node: int, prompt: Sequence[int], max_tokens: int) -> int:
        """The request is on its way to ``node``: apply it to the mirror (returns cached)."""
        self.inflight[node] += 1
        return self.mirrors[node].serve(prompt, max_tokens)

    def finished(
        self,
        node: int,
        uncached: int,
        cached: int,
        service_s: float | None,
        predicted: int,
        actual: int | None,
    ) -> None:
        self.inflight[node] -= 1
        if actual is not None and actual != predicted:
            self.mismatches += 1
        if service_s is not None and service_s > 0:
            self.models[node].observe_prefill(uncached, cached, service_s)
            self.models[node].observe_service(service_s)
