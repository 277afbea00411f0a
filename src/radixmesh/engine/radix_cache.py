"""The radix KV cache: KV tensors hung on the nodes of the exact radix tree.

Theory of operation
-------------------
Each tree node's value is one tensor ``[layers, 2, kv_heads, T, head_dim]`` holding the keys
(index 0) and values (index 1) of exactly that node's ``T`` token positions, at their original
absolute positions (rotary embeddings are already applied, so a segment is only valid there —
which is exactly what a radix path guarantees). Values are *copies*, never views: a view would
pin the whole request's KV in memory. Splitting a node splits its tensor along ``T``::

    root ─[0..512) KV─▶ A ─[512..590) KV─▶ B        KV(prefix of B) = cat(A.kv, B.kv) along T

A request runs in four steps (the paper's Algorithm 1, lines 7–13)::

    acquire(prompt)   match_prefix(prompt[:-1]) (>= 1 token is always computed), lock the path,
                      evict LRU leaves until the request's new tokens fit the budget
    RequestCache(lease.values)   copy the path's tensors into per-layer buffers sized for the
                      request (prefix + new tokens); the model appends in place
    ... the engine runs prefill + decode on that RequestCache ...
    commit(lease, seq, kv)  insert the sequence's tokens (prompt + generated) with KV slices
                      cloned from the request cache, evicting again if needed; unlock

Budget: ``total_tokens <= budget`` always. Eviction frees unlocked leaves least-recently-used
first; if locked paths leave too little room the insert is truncated to what fits (the cache
then holds a shorter prefix — correct, merely less useful). Block-hash changes are journaled
by the tree and drained for gossip. The budget bounds the *cache*; a running request also
holds its own working buffer (prefix copy + new tokens) until it commits.

Thread safety: one ``threading.Lock`` guards the tree, so ``match`` (event-loop thread) can run
while a request computes on the worker thread; tensors are only read outside the lock after
their path is locked (locked nodes are never evicted; splits keep tensor contents intact).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from radixmesh.core.radix import RadixTree, TreeNode
from radixmesh.engine.base import CacheUsage

KV = torch.Tensor  # [layers, 2, kv_heads, T, head_dim]
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), [1, kv_heads, T, head_dim]


def split_kv(value: KV, at: int) -> tuple[KV, KV]:
    return value[:, :, :, :at].clone(), value[:, :, :, at:].clone()


@dataclass(slots=True)
class Lease:
    """A running request's hold on its matched path; valid until ``commit`` or ``release``."""

    cached: int  # prompt tokens whose KV is reused
    node: TreeNode[KV]
    values: list[KV]
    active: bool = True


class RadixKVCache:
    def __init__(self, budget_tokens: int, block_size: int, seed: int) -> None:
        if budget_tokens < 0:
            raise ValueError("cache budget must be >= 0 tokens")
        self.budget = budget_tokens
        self.tree: RadixTree[KV] = RadixTree(block_size, seed, split_kv)
        self._mutex = threading.Lock()
        self.evicted_tokens = 0  # lifetime counter

    # ------------------------------------------------------------------------- read-only
    def match(self, tokens: Sequence[int]) -> int:
        with self._mutex:
            return self.tree.match(tokens)

    def usage(self) -> CacheUsage:
        with self._mutex:
            return CacheUsage(self.tree.total_tokens, self.budget, self.tree.locked_tokens)

    def block_hashes(self) -> frozenset[int]:
        with self._mutex:
            return self.tree.block_hashes()

    def drain_delta(self) -> tuple[list[int], list[int]]:
        with self._mutex:
            return self.tree.drain_delta()

    def clear(self) -> int:
        """Evict every unlocked entry (removals are journaled); returns tokens freed."""
        with self._mutex:
            freed = sum(ev.tokens for ev in self.tree.evict(self.tree.total_tokens))
            self.evicted_tokens += freed
            return freed

    # ------------------------------------------------------------------------- serving
    def acquire(self, prompt: Sequence[int], reserve: int, now: float) -> Lease:
        """Match and lock the cached prefix of ``prompt`` (all but its last token).

        ``reserve`` is how many new tokens the request will add; LRU leaves are evicted so they
        fit (as far as unlocked entries allow).
        """
        with self._mutex:
            found = self.tree.match_prefix(prompt[: max(len(prompt) - 1, 0)], now)
            self.tree.lock(found.node)
            self._make_room(reserve)
            return Lease(found.length, found.node, list(found.values))

    def release(self, lease: Lease) -> None:
        with self._mutex:
            self._unlock(lease)

    def commit(self, lease: Lease, tokens: Sequence[int], kv: LayerKV, now: float) -> int:
        """Insert ``tokens`` (whose KV is ``kv``, positions 0..len) and unlock; returns #added."""
        with self._mutex:
            try:
                return self._insert(tokens, kv, now)
            finally:
                self._unlock(lease)

    # ------------------------------------------------------------------------- helpers
    def _unlock(self, lease: Lease) -> None:
        if lease.active:
            lease.active = False
            self.tree.unlock(lease.node)

    def _make_room(self, n_tokens: int) -> int:
        """Evict until ``n_tokens`` more fit; returns how many fit now."""
        need = self.tree.total_tokens + n_tokens - self.budget
        if need > 0:
            for ev in self.tree.evict(need):
                self.evicted_tokens += ev.tokens
        return max(self.budget - self.tree.total_tokens, 0)

    def _insert(self, tokens: Sequence[int], kv: LayerKV, now: float) -> int:
        have = self.tree.match(tokens)
        room = self._make_room(len(tokens) - have)
        end = min(len(tokens), have + room)
        if end <= have:
            return 0

        def make_value(start: int, stop: int) -> KV:
            return torch.stack(
                [torch.stack((k[0, :, start:stop], v[0, :, start:stop])) for k, v in kv]
            )

        self.tree.insert(tokens[:end], now, make_value)
        return end - have


class GrowingLayer(DynamicLayer):
    """One layer's request KV in a preallocated buffer; ``keys``/``values`` are views of it.

    transformers' ``DynamicLayer`` concatenates the whole cache on every decode step (O(T)
    copies per token); this layer writes new positions in place and doubles when full. The
    cached prefix is copied straight from the tree's segments into the buffer (one copy).
    """

    def __init__(self, capacity: int, segments: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self._capacity = max(capacity, 1)
        self._n = 0
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        if segments:  # each [2, kv_heads, T, head_dim]
            first = segments[0]
            self._allocate(first.shape[1], first.shape[3], first.dtype, first.device)
            for seg in segments:
                self._write(seg[0].unsqueeze(0), seg[1].unsqueeze(0))

    def _allocate(self, heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (1, heads, self._capacity, dim)
        self._kbuf = torch.empty(shape, dtype=dtype, device=device)
        self._vbuf = torch.empty(shape, dtype=dtype, device=device)
        self.device, self.is_initialized = device, True

    def _write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        assert self._kbuf is not None and self._vbuf is not None
        end = self._n + k.shape[-2]
        if end > self._kbuf.shape[2]:
            self._grow(end)
        self._kbuf[:, :, self._n : end] = k
        self._vbuf[:, :, self._n : end] = v
        self._n = end
        self.keys, self.values = self._kbuf[:, :, :end], self._vbuf[:, :, :end]

    def _grow(self, need: int) -> None:
        assert self._kbuf is not None and self._vbuf is not None
        cap = max(need, 2 * self._kbuf.shape[2])
        pad = (0, 0, 0, cap - self._kbuf.shape[2])
        self._kbuf = torch.nn.functional.pad(self._kbuf, pad)
        self._vbuf = torch.nn.functional.pad(self._vbuf, pad)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(
            key_states.shape[1], key_states.shape[3], key_states.dtype, key_states.device
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kw: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._write(key_states, value_states)
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._n


class RequestCache(DynamicCache):
    """A request's KV cache: the cached prefix (copied once) + room for its new tokens."""

    def __init__(self, n_layers: int, capacity: int, values: Sequence[KV] = ()) -> None:
        layers = [GrowingLayer(capacity, [v[i] for v in values]) for i in range(n_layers)]
        Cache.__init__(self, layers=layers)  # type: ignore[arg-type]
