"""The ``oracle`` baseline: exact, instantaneous knowledge of every node's cache, same cost model.

Design (client-side, so no node needs a special mode):

* Nodes run policy ``none`` (they never route). The benchmark client keeps a *mirror* of each
  node's cache: the engine's very cache code (``core.prefix_cache.PrefixCache``, with no
  values), the same budget, fed what the engine feeds it in the same order: ``acquire`` when a
  request starts (match, lock, make room for prompt + output budget), ``commit`` when it ends
  with the prompt's token ids (chat messages through the chat template) *and the generated
  tokens the engine ran through the model* (all of them when it stopped on a stop token, all
  but the last when it hit ``max_tokens``). Every record checks it: the oracle's predicted
  ``expected_cached_tokens`` vs the node's ``cached_tokens``; mismatches are counted in the
  summary. It is what an infinitely fast, free gossip would give: the bound on what better
  gossip could buy.
* Generated tokens come back as text only; :func:`output_ids` turns the text back into ids
  where that is certain (the byte tokenizer: every byte before the first undecodable one) and
  marks the rest with :data:`UNKNOWN`, a token id no prompt contains, so the mirror holds the
  right *number* of tokens (same budget, same evictions) and no prompt matches past what the
  engine would match. Multi-turn traces that resend an earlier answer therefore match in the
  mirror exactly as far as in the engine.
* For each request the oracle ranks nodes with the *same* :class:`~radixmesh.core.router.Router`
  under policy ``cost``, with exact cached-token counts, the exact number of requests the client
  has in flight at each node, the known round-trip of a forward (2 × the emulated one-way delay
  + 1 ms of HTTP), and a per-node :class:`~radixmesh.core.estimators.ComputeModel` learnt from the
  latencies the client observed.
* The client sends the request to its entry node with ``x-radixmesh-target: <chosen node>``;
  the entry node forwards it through the real peer path (emulated delay both ways, HTTP, the
  same fallback rules), so a forward costs exactly what it costs any policy. The decision
  itself (a few µs in the client) is free — that is the "instantaneous knowledge".

On an emulated mesh (``profiles`` given) the oracle also keeps each engine's scheduler, as
a node's shadow does (``core/shadow.py``, the engine's profile and time scale, fed every
request started and ended there): the cached prefix it ranks with is that scheduler's (the
engine's KV pool, not ``budget_tokens``), and every node is priced by its predicted TTFT
from its exact batch, as a profiled node prices itself.

Limitations (stated in the report): under concurrency, the order in which a node's engine
starts and finishes requests can differ from the client's, so the mirror may drift slightly
(mismatches are counted); an output that a non-byte tokenizer does not re-encode to the same
number of tokens is mirrored as unknown tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from radixmesh.core.byte_tokenizer import ByteTokenizer
from radixmesh.core.estimators import ComputeModel, CostPriors, speed_is_stale
from radixmesh.core.prefix_cache import Lease, PrefixCache
from radixmesh.core.profile import Profile
from radixmesh.core.router import NodeInfo, Policy, RouteInput, Router, RouterConfig
from radixmesh.core.shadow import Shadow

HTTP_OVERHEAD_S = 0.001
UNKNOWN = 2**32 - 1  # a token id no tokenizer produces (block hashes pack ids as uint32)
REPLACEMENT = "\ufffd"


def output_ids(tokenizer: Any, text: str | None, n: int) -> list[int]:
    """The ``n`` generated token ids behind ``text``, :data:`UNKNOWN` where not certain."""
    if n <= 0:
        return []
    text = text or ""
    ids = list(tokenizer.encode(text))
    if len(ids) == n and REPLACEMENT not in text and tokenizer.decode(ids) == text:
        return ids
    head = ids[:0]
    if isinstance(tokenizer, ByteTokenizer):  # bytes before the first undecodable one
        head = tokenizer.encode(text.split(REPLACEMENT, 1)[0])[:n]
    return head + [UNKNOWN] * (n - len(head))


def fed_output(ids: Sequence[int], finish_reason: str | None) -> list[int]:
    """The generated tokens the engine ran through the model (and so cached): the last one
    sampled at ``max_tokens`` never is; a stop token is not among ``ids``."""
    return list(ids) if finish_reason == "stop" else list(ids[:-1])


class CacheMirror:
    """Bookkeeping replica of one node's prefix cache (the engine's cache code, no values)."""

    def __init__(self, budget_tokens: int, block_size: int, max_context: int) -> None:
        self.cache: PrefixCache[None] = PrefixCache(budget_tokens, block_size, seed=0)
        self.max_context = max_context
        self._clock = 0.0

    def match(self, prompt: Sequence[int]) -> int:
        """Tokens the node would reuse: whole KV blocks, never the last token (the built-in
        engine's paged pool, ``core/kv_pool.KvPool.reusable``)."""
        bs = self.cache.tree.block_size
        return self.cache.reusable(prompt) // bs * bs

    def start(self, prompt: Sequence[int], max_tokens: int) -> Lease[None]:
        """``generate``'s first cache step: lock the cached whole blocks, make room."""
        self._clock += 1.0
        budget = min(max_tokens, self.max_context - len(prompt))
        reserve = self.cache.reserve_for(prompt, budget)
        return self.cache.acquire(prompt[: self.match(prompt) + 1], reserve, self._clock)

    def finish(self, lease: Lease[None], fed: Sequence[int] | None) -> None:
        """``generate``'s last step: insert the whole blocks of what went through the model
        (None: nothing)."""
        self._clock += 1.0
        if fed is None:
            self.cache.release(lease)
        else:
            bs = self.cache.tree.block_size
            self.cache.commit(lease, fed[: len(fed) // bs * bs], self._clock)


class Oracle:
    """Chooses the serving node for each request from exact cache state."""

    def __init__(
        self,
        node_ids: Sequence[str],
        budget_tokens: int,
        block_size: int,
        comm_delay_s: float,
        seed: int,
        max_context: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        profiles: Sequence[Profile] | None = None,
        time_scale: float = 1.0,
    ) -> None:
        self.node_ids = list(node_ids)
        self.shadows = None if profiles is None else [Shadow(p, time_scale) for p in profiles]
        self._shadowed: dict[int, tuple[int, int]] = {}  # id(lease) -> (node, shadow seq)
        self._seq = 0
        self.mirrors = [CacheMirror(budget_tokens, block_size, max_context) for _ in node_ids]
        self.rtt_s = 2 * comm_delay_s + HTTP_OVERHEAD_S
        priors = CostPriors(rtt_s=self.rtt_s)
        self.models = [ComputeModel(priors) for _ in node_ids]
        self.inflight = [0 for _ in node_ids]
        self.router = Router(RouterConfig(policy=Policy.COST))
        self.rng = random.Random(seed)
        self.mismatches = 0
        self.clock = clock
        # when each node's speed was last measured or adopted; None: still the prior
        self.measured: list[float | None] = [None for _ in node_ids]
        self.speed_restarts = 0

    def _refresh_stale_speeds(self) -> None:
        """The nodes' rule (``estimators.speed_is_stale``): a node's speed that was never
        measured, or that no request refreshed for a load window with nothing in flight
        there, restarts from the median of the nodes that served within it. Without it the
        oracle sent every request of a run to the node whose warm-up looked fastest (the
        others' estimates never changed again): 100 % on one node, and under memory
        pressure `none`'s latency."""
        now, window = self.clock(), self.router.config.load_window_s
        stale = [i for i, t in enumerate(self.measured)
                 if speed_is_stale(t, self.inflight[i] > 0, now, window)]
        if not stale:  # the usual case: nothing to compute per request
            return
        fresh = [m.report() for m, t in zip(self.models, self.measured, strict=True)
                 if t is not None and now - t < window]
        for i in stale:
            if self.measured[i] is not None:
                self.measured[i] = now  # (checked again a window later)
            if self.models[i].restart_from(fresh):
                self.measured[i] = now
                self.speed_restarts += 1

    def choose(self, prompt: Sequence[int], max_tokens: int, entry: int) -> tuple[int, int]:
        """(node index, predicted cached tokens) for a request entering at ``entry``."""
        self._refresh_stale_speeds()
        now, shadows = self.clock(), self.shadows
        infos = [
            NodeInfo(
                node_id=nid,
                is_self=i == entry,
                cached_tokens=self.mirrors[i].match(prompt) if shadows is None
                else shadows[i].cached_prefix(prompt),
                rtt_s=0.0 if i == entry else self.rtt_s,
                queue_depth=self.inflight[i],
                speed=self.models[i].report(),
                batch=None if shadows is None else shadows[i].state(now),
            )
            for i, nid in enumerate(self.node_ids)
        ]
        head = self.router.rank(RouteInput(len(prompt), max_tokens), infos, self.rng)[0]
        return self.node_ids.index(head.node_id), head.expected_cached_tokens

    def started(self, node: int, prompt: Sequence[int], max_tokens: int) -> Lease[None]:
        """The request is on its way to ``node``: its cache step there (lease.cached)."""
        self.inflight[node] += 1
        lease = self.mirrors[node].start(prompt, max_tokens)
        if self.shadows is not None:
            self._seq += 1
            self._shadowed[id(lease)] = (node, self._seq)
            self.shadows[node].add(self._seq, prompt, max_tokens, self.clock())
        return lease

    def finished(
        self,
        node: int,
        lease: Lease[None],
        prompt_len: int,
        fed: Sequence[int] | None,
        service_s: float | None,
    ) -> None:
        """The request ended: commit ``fed`` (prompt + generated ids, None if it failed) and
        learn the node's speed from ``service_s``."""
        self.inflight[node] -= 1
        shadowed = self._shadowed.pop(id(lease), None)
        if self.shadows is not None and shadowed is not None:
            self.shadows[shadowed[0]].finished(shadowed[1], self.clock())
        self.mirrors[node].finish(lease, fed)
        if service_s is not None and service_s > 0:
            self.models[node].observe_prefill(prompt_len - lease.cached, lease.cached, service_s)
            self.models[node].observe_service(service_s)
            self.measured[node] = self.clock()

    def check(self, predicted: int, actual: int | None) -> None:
        if actual is not None and actual != predicted:
            self.mismatches += 1
