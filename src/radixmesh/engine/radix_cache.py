"""The radix KV cache: KV tensors hung on the nodes of the shared budgeted prefix cache.

Theory of operation
-------------------
Budget, LRU eviction, leases and the block-hash journal are ``core.prefix_cache.PrefixCache``
(the simulator runs the same code); this module adds only what is specific to KV tensors.

Each tree node's value is one tensor ``[layers, 2, kv_heads, T, head_dim]`` holding the keys
(index 0) and values (index 1) of exactly that node's ``T`` token positions, at their original
absolute positions (rotary embeddings are already applied, so a segment is only valid there —
which is exactly what a radix path guarantees). Values are *copies*, never views: a view would
pin the whole request's KV in memory. Splitting a node splits its tensor along ``T``
(:func:`split_kv`)::

    root ─[0..512) KV─▶ A ─[512..590) KV─▶ B        KV(prefix of B) = cat(A.kv, B.kv) along T

A request runs in four steps (the lease lifecycle of ``core/prefix_cache.py``)::

    acquire(prompt, reserve)   match prompt[:-1], lock the path, evict so ``reserve`` fits
    RequestCache(lease.values) copy the path's tensors into per-layer buffers sized for the
                               request (prefix + new tokens); the model appends in place
    ... the engine runs prefill + decode on that RequestCache ...
    commit(lease, seq, kv)     insert the sequence's tokens (prompt + generated) with KV slices
                               cloned from the request cache, truncated to the room; unlock

Thread safety: one ``threading.Lock`` guards the prefix cache, so ``match`` (event-loop thread)
can run while a request computes on the worker thread; tensors are only read outside the lock
after their path is locked (locked nodes are never evicted; splits keep tensor contents intact).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from radixmesh.core.prefix_cache import CacheUsage, Lease, PrefixCache
from radixmesh.core.radix import RadixTree

KV = torch.Tensor  # [layers, 2, kv_heads, T, head_dim]
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), [1, kv_heads, T, head_dim]
KVLease = Lease[KV]


def split_kv(value: KV, at: int) -> tuple[KV, KV]:
    return value[:, :, :, :at].clone(), value[:, :, :, at:].clone()


def kv_slicer(kv: LayerKV) -> Callable[[int, int], KV]:
    """Node values from a request's per-layer KV: positions ``[start, stop)``, copied."""

    def make_value(start: int, stop: int) -> KV:
        return torch.stack([torch.stack((k[0, :, start:stop], v[0, :, start:stop])) for k, v in kv])

    return make_value


class RadixKVCache:
    """``PrefixCache[KV]`` behind a mutex; every method is one locked call into it."""

    def __init__(self, budget_tokens: int, block_size: int, seed: int) -> None:
        self._cache: PrefixCache[KV] = PrefixCache(budget_tokens, block_size, seed, split_kv)
        self._mutex = threading.Lock()

    # ------------------------------------------------------------------------- inspection
    @property
    def tree(self) -> RadixTree[KV]:
        """The radix tree, for inspection (tests, benchmarks); never mutate it."""
        return self._cache.tree

    @property
    def budget(self) -> int:
        return self._cache.budget

    @property
    def evicted_tokens(self) -> int:
        return self._cache.evicted_tokens

    # ------------------------------------------------------------------------- read-only
    def match(self, tokens: Sequence[int]) -> int:
        with self._mutex:
            return self._cache.match(tokens)

    def reusable(self, prompt: Sequence[int]) -> int:
        with self._mutex:
            return self._cache.reusable(prompt)

    def reserve_for(self, prompt: Sequence[int], max_new: int) -> int:
        with self._mutex:
            return self._cache.reserve_for(prompt, max_new)

    def usage(self) -> CacheUsage:
        with self._mutex:
            return self._cache.usage()

    def block_hashes(self) -> frozenset[int]:
        with self._mutex:
            return self._cache.block_hashes()

    def drain_delta(self) -> tuple[list[int], list[int]]:
        with self._mutex:
            return self._cache.drain_delta()

    # ------------------------------------------------------------------------- serving
    def acquire(self, prompt: Sequence[int], reserve: int, now: float) -> KVLease:
        """``PrefixCache.acquire``: lock the cached prefix of ``prompt[:-1]``, make room."""
        with self._mutex:
            return self._cache.acquire(prompt, reserve, now)

    def release(self, lease: KVLease) -> None:
        with self._mutex:
            self._cache.release(lease)

    def commit(self, lease: KVLease, tokens: Sequence[int], kv: LayerKV, now: float) -> int:
        """Insert ``tokens`` (whose KV is ``kv``, positions 0..len) and unlock; returns #added."""
        with self._mutex:
            return self._cache.commit(lease, tokens, now, kv_slicer(kv))

    def clear(self) -> int:
        """Evict every unlocked entry (removals are journaled); returns tokens freed."""
        with self._mutex:
            return self._cache.clear()


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
