"""The built-in engine's KV memory: one pool of fixed-size blocks, shared by reference.

Theory of operation
-------------------
The core scheduler (``core/scheduler.py``) decides *how many* KV blocks each sequence and the
prefix cache hold (``core/kv_pool.py`` counts them); this module decides *which* physical
blocks, and holds the tensors::

    k, v : [layers, kv_heads, kv_blocks * block_size, head_dim]     (slot = block * bs + offset)

Every physical block has exactly one owner: the free list, one running sequence (its private
blocks), or the prefix cache (``_cached``: chained block hash -> block, the same hashes as the
scheduler's cache and the node's index). A sequence's *table* lists its blocks in position order:
first the cached blocks of its reused prefix (owned by the cache: shared, read by reference,
never copied), then its own. The scheduler's cache journal (``drain_cache_delta``: net added and
removed hashes) moves ownership:

* admitted with ``start`` cached tokens: its table starts with the cache's blocks for the first
  ``start / block_size`` hashes of its prompt (``admit``);
* a hash *added* by a sequence whose prefill completed or which finished is one of that
  sequence's own blocks: ownership moves to the cache (``adopt``), no copy; a block it computed
  that another sequence already cached is swapped for the cached one and freed (``dedupe``),
  as the scheduler's ``publish`` does for its block count;
* a hash *removed* (LRU eviction) frees its block (``forget``): the scheduler only evicts
  entries no running sequence locks, so no table still reads it.

The scheduler's private blocks of a sequence are ``ceil((kv - cached) / block_size)``, this
table's length minus its shared head. Its cache count, ``ceil(cached tokens / block_size)``, is a
lower bound of the blocks here: where two cached prefixes part inside a block, each branch's
block is a whole physical block (one per block hash, as in vLLM) though the tree counts the
shared tokens once. So the pool has ``slack`` blocks beyond the scheduler's ``kv_blocks``, and
when ``ensure`` still finds none free it asks ``reclaim`` (the runner evicts the least recently
used unlocked entry through the scheduler's cache, so the journal and the node's index stay
exact) before it gives up.
``kv_bytes_copied`` counts KV bytes ever copied from one slot to another: the executor has no
such path (a prefix hit reads the cached blocks in place), so it stays 0; it is reported so a
regression would show.

Attention (:func:`paged_attention`, registered with transformers' ``AttentionInterface``) runs
inside the stock model's forward over one *packed* row of every token of a step: each layer
writes the step's new K/V into their slots, then each prefill chunk attends causally to its
sequence's slots ``0 .. start + n`` and all decode tokens attend together (one padded SDPA over
their gathered contexts). Every SDPA call is 4-D with ``enable_gqa``, so torch takes its fused
(flash) CPU kernel; a 3-D call falls back to the unfused one (scores materialised, masked,
softmaxed: 2.5x the time of the fused one, a third of a 500-token prefill). Without a step (a
plain ``model(...)`` call: references, HF ``generate``) it is ordinary causal SDPA aligned to the
end of the keys. A step's forward runs in pieces of at most ``PIECE_TOKENS`` prefill tokens
(:func:`pieces`): the KV a piece writes is in the pool before the next one reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa
from transformers import AttentionInterface

from radixmesh.core.step import PrefillChunk, Step

ATTENTION = "radixmesh_paged"
QUERY_ROWS = 64  # prefill queries per SDPA call: 64 rows skip more of the causal triangle than 256
# (a 500-token prompt's attention 2.45 against 3.05 ms a layer); the mask, 64 x 32k as fp32, 8 MiB
PIECE_TOKENS = 512  # prefill tokens per model call (``pieces``)


def pieces(step: Step, budget: int) -> list[Step]:
    """``step`` cut into consecutive pieces of at most ``budget`` prefill tokens (a chunk split
    across two: its second part reads the first's KV, already written to the pool), the decodes
    with the last piece; their emitting sequences, concatenated, are ``step.emitting``. The same
    tokens and KV as one forward; what changes is the activations' size: a 2,048-token step's MLP
    activations (8 MiB each) spill the CPU's caches, and 8 x 500-token prompts took 10 % less CPU
    in 512-token pieces on the 2-core box."""
    out: list[list[PrefillChunk]] = [[]]
    room = budget
    for c in step.prefills:
        start, left = c.start, c.tokens
        while left:
            if room == 0:
                out.append([])
                room = budget
            n = min(left, room)
            out[-1].append(PrefillChunk(c.seq, start, n, c.last and n == left))
            start, left, room = start + n, left - n, room - n
    last = len(out) - 1
    return [Step(tuple(p), step.decodes if i == last else (), ()) for i, p in enumerate(out)]


SeqId = int


def slack_blocks(kv_blocks: int) -> int:
    """Physical blocks beyond the scheduler's count (module docstring): 1/16 more, >= 4."""
    return max(kv_blocks // 16, 4)


@dataclass(slots=True)
class StepBatch:
    """What one packed forward attends over (built by ``PagedKV.batch``)."""

    kv: PagedKV
    write: torch.Tensor  # [T] slot of each new token
    prefills: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)
    # (row, tokens, start, context slots [start + tokens]) per prefill chunk
    decode_rows: torch.Tensor | None = None  # [B] rows of the decode tokens
    decode_slots: torch.Tensor | None = None  # [B, Lmax] context slots, padded
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] True where a real slot


class PagedKV:
    """Physical KV blocks; see the module docstring. Not thread-safe (the engine thread's)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, kv_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        kv_blocks += slack_blocks(kv_blocks)
        # torch.empty: a page is committed only when a token is first written there (a big pool
        # costs no memory up front); one more slot, zeroed, pads the decode batch's contexts
        # (garbage there could be NaN, and NaN x a zero attention weight is still NaN).
        shape = (layers, kv_heads, kv_blocks * block_size + 1, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.null_slot = kv_blocks * block_size
        self.k[:, :, self.null_slot].zero_()
        self.v[:, :, self.null_slot].zero_()
        self.block_size = block_size
        self.kv_blocks = kv_blocks
        self.device = device
        self._free = list(range(kv_blocks - 1, -1, -1))
        self._cached: dict[int, int] = {}  # block hash -> block
        self._owner: dict[int, int] = {}  # cached block -> its hash
        self._tables: dict[SeqId, list[int]] = {}
        self.kv_bytes_copied = 0

    # ------------------------------------------------------------------------- read-only
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def cached_blocks(self) -> int:
        return len(self._cached)

    def private_blocks(self, seq: SeqId) -> int:
        return sum(1 for b in self._tables.get(seq, ()) if b not in self._owner)

    def table(self, seq: SeqId) -> list[int]:
        return self._tables[seq]

    def has(self, seq: SeqId) -> bool:
        return seq in self._tables

    # ------------------------------------------------------------------------- ownership
    def admit(self, seq: SeqId, hashes: Sequence[int], cached_tokens: int) -> None:
        """A sequence starts (again) reusing the cached blocks of its first ``cached_tokens``."""
        if seq in self._tables:
            raise RuntimeError(f"paged KV: seq {seq} admitted twice")
        n = cached_tokens // self.block_size
        self._tables[seq] = [self._cached[h] for h in hashes[:n]]

    def ensure(self, seq: SeqId, kv_tokens: int, reclaim: Callable[[], bool]) -> None:
        """Give ``seq`` blocks for ``kv_tokens`` positions (``reclaim`` frees cached ones)."""
        table = self._tables[seq]
        while len(table) * self.block_size < kv_tokens:
            if not self._free and not reclaim():
                raise RuntimeError("paged KV: out of blocks with nothing left to evict")
            if self._free:
                table.append(self._free.pop())

    def adopt(self, seq: SeqId, hashes: Sequence[int], added: set[int]) -> None:
        """The cache now holds the ``added`` hashes among ``seq``'s blocks: move them."""
        table = self._tables.get(seq, ())
        for i, h in enumerate(hashes[: len(table)]):
            b = table[i]
            if h in added and h not in self._cached and b not in self._owner:
                self._cached[h], self._owner[b] = b, h

    def dedupe(self, seq: SeqId, hashes: Sequence[int]) -> None:
        """Read the cached copy of every leading block the cache holds; free our duplicate."""
        table = self._tables[seq]
        for i, h in enumerate(hashes[: len(table)]):
            b = self._cached.get(h)
            if b is None:
                return
            if table[i] != b:
                self._release_block(table[i])
                table[i] = b

    def drop(self, seq: SeqId) -> None:
        """A sequence left (finished, aborted, preempted): free its own blocks."""
        for b in self._tables.pop(seq, ()):
            self._release_block(b)

    def forget(self, removed: Sequence[int]) -> None:
        """The cache evicted these hashes: free their blocks."""
        for h in removed:
            b = self._cached.pop(h, None)
            if b is not None:
                del self._owner[b]
                self._free.append(b)

    def clear(self) -> list[int]:
        """Drop every cached block (no sequence may be running); the hashes dropped."""
        if self._tables:
            raise RuntimeError("paged KV: cannot clear while sequences hold blocks")
        hashes = list(self._cached)
        self.forget(hashes)
        return hashes

    def _release_block(self, b: int) -> None:
        if b not in self._owner:
            self._free.append(b)

    # ------------------------------------------------------------------------- a step
    def slots(self, seq: SeqId, start: int, stop: int) -> torch.Tensor:
        """Slots of ``seq``'s positions ``start .. stop - 1``."""
        pos = torch.arange(start, stop)
        blocks = torch.tensor(self._tables[seq], dtype=torch.long)
        return (blocks[pos // self.block_size] * self.block_size + pos % self.block_size).to(
            self.device)

    def batch(self, prefills: Sequence[tuple[SeqId, int, int]],
              decodes: Sequence[tuple[SeqId, int]]) -> StepBatch:
        """The packed step: prefill chunks ``(seq, start, n)`` then decodes ``(seq, context)``."""
        write: list[torch.Tensor] = []
        out = StepBatch(self, torch.empty(0))
        row = 0
        for seq, start, n in prefills:
            ctx = self.slots(seq, 0, start + n)
            out.prefills.append((row, n, start, ctx))
            write.append(ctx[start:])
            row += n
        if decodes:
            idx, mask, last = self._decode_slots(decodes)
            write.append(last)
            out.decode_rows = torch.arange(row, row + len(decodes), device=self.device)
            out.decode_slots, out.decode_mask = idx, mask
        out.write = torch.cat(write)
        return out

    def _decode_slots(self, decodes: Sequence[tuple[SeqId, int]]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decodes' context slots ``[B, Lmax]`` (``null_slot`` past each context), their
        mask ``[B, 1, 1, Lmax]`` and each one's last slot ``[B]`` (its new token's), from one
        padded block table: a few tensor ops for the whole batch, not a loop of them."""
        bs = self.block_size
        ctx = torch.tensor([c for _, c in decodes])
        width = -(-int(ctx.max()) // bs)
        rows = [self._tables[seq][:width] for seq, _ in decodes]
        tables = torch.tensor([t + [0] * (width - len(t)) for t in rows])
        pos = torch.arange(width * bs)
        valid = pos < ctx[:, None]
        idx = torch.where(valid, tables[:, pos // bs] * bs + pos % bs, self.null_slot)
        last = idx.gather(1, (ctx - 1)[:, None])[:, 0]
        dev = self.device
        return idx.to(dev), valid[:, None, None, :].to(dev), last.to(dev)


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    dropout: float = 0.0, scaling: float | None = None,
                    **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers attention over the paged pool (module docstring); ``query`` is
    ``[1, heads, T, dim]``, ``key`` / ``value`` ``[1, kv_heads, T, dim]``; returns
    ``[1, T, heads, dim]``. Grouped-query heads are folded into the query rows of their KV
    head (head ``h`` reads KV head ``h // group``, as transformers' ``repeat_kv``), so no KV is
    expanded."""
    batch = kwargs.get("rm_batch")
    if not isinstance(batch, StepBatch):
        return _dense(query, key, value, attention_mask, scaling), None
    layer = int(getattr(module, "layer_idx"))  # noqa: B009 - set by every HF attention module
    pk, pv = batch.kv.k[layer], batch.kv.v[layer]  # [kv_heads, slots, dim]
    pk.index_copy_(1, batch.write, key[0])
    pv.index_copy_(1, batch.write, value[0])
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    group = heads // kv_heads
    out = torch.empty(query.shape[2], heads, dim, dtype=query.dtype, device=query.device)
    for row, n, start, ctx in batch.prefills:
        k, v = pk.index_select(1, ctx)[None], pv.index_select(1, ctx)[None]
        for a in range(0, n, QUERY_ROWS):  # bounds the mask: rows x context
            b = min(a + QUERY_ROWS, n)
            mask = torch.ones(b - a, start + b, dtype=torch.bool, device=query.device)
            o = sdpa(query[:, :, row + a : row + b], k[:, :, : start + b], v[:, :, : start + b],
                     attn_mask=mask.tril(start + a), scale=scaling, enable_gqa=True)
            out[row + a : row + b] = o[0].transpose(0, 1)
    if batch.decode_rows is not None:
        assert batch.decode_slots is not None and batch.decode_mask is not None
        n_dec, lmax = batch.decode_slots.shape
        flat = batch.decode_slots.reshape(-1)
        k = pk.index_select(1, flat).view(kv_heads, n_dec, lmax, dim).transpose(0, 1)
        v = pv.index_select(1, flat).view(kv_heads, n_dec, lmax, dim).transpose(0, 1)
        q = query[0][:, batch.decode_rows].transpose(0, 1).reshape(n_dec, kv_heads, group, dim)
        o = sdpa(q, k, v, attn_mask=batch.decode_mask, scale=scaling)  # [B, kv_heads, group, dim]
        out[batch.decode_rows] = o.reshape(n_dec, heads, dim)
    return out.unsqueeze(0), None


def _dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """Plain causal attention, queries aligned to the end of the keys (a KV cache's layout)."""
    n, total = query.shape[2], key.shape[2]
    if mask is None:
        mask = torch.ones(n, total, dtype=torch.bool, device=query.device).tril(total - n)
    o = sdpa(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return o.transpose(1, 2).contiguous()


AttentionInterface.register(ATTENTION, paged_attention)
