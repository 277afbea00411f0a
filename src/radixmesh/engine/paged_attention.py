"""Attention over the paged KV pool, inside the stock transformers model's forward.

Theory of operation
-------------------
:func:`paged_attention` is registered with transformers' ``AttentionInterface`` as
``ATTENTION``; ``BatchRunner`` sets it as the model's attention and passes each forward its
:class:`~radixmesh.engine.paged_kv.StepBatch` (``rm_batch``). It runs over one *packed* row of
every token of a step: each layer writes the step's new K/V into their slots of the pool
(``engine/paged_kv.py``; a chunk's run of consecutive slots as one slice copy, ``index_copy_``
was 4x slower at 500 tokens), then

* each prefill chunk attends causally to its sequence's slots ``0 .. start + n`` (a view of
  the pool when they are one run, else gathered; ``QUERY_ROWS`` queries per SDPA call,
  bounding the mask);
* a decode whose context is one run of consecutive slots attends to a *view* of the pool (no
  copy; the pool places blocks so that this is the common case), one SDPA call of its own;
* the other decodes attend together: their contexts gathered into one padded SDPA (a copy of
  their KV per layer).

Every SDPA call is 4-D (``enable_gqa``, or grouped-query heads folded into the query rows of
their KV head), so torch takes its fused (flash) CPU kernel; a 3-D call falls back to the
unfused one (scores materialised, masked, softmaxed: 2.5x the time of the fused one, a third
of a 500-token prefill). Without a step (a plain ``model(...)`` call: references, HF
``generate``) it is ordinary causal SDPA aligned to the end of the keys.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa
from transformers import AttentionInterface

from radixmesh.engine.paged_kv import StepBatch

ATTENTION = "radixmesh_paged"
QUERY_ROWS = 64  # prefill queries per SDPA call: 64 rows skip more of the causal triangle than 256
# (a 500-token prompt's attention 2.45 against 3.05 ms a layer); the mask, 64 x 32k as fp32, 8 MiB


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
    _write(pk, key[0], batch)
    _write(pv, value[0], batch)
    out = torch.empty(query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype,
                      device=query.device)  # [T, heads, dim]
    _prefills(out, query, pk, pv, batch, scaling)
    _decodes(out, query[0].transpose(0, 1), pk, pv, batch, scaling)
    return out.unsqueeze(0), None


def _write(pool: torch.Tensor, new: torch.Tensor, batch: StepBatch) -> None:
    """The step's new K (or V) ``[kv_heads, T, dim]`` into their slots of a layer's pool."""
    for row, n, first in batch.write_runs:
        pool[:, first : first + n] = new[:, row : row + n]
    for row, slots in batch.writes:
        pool.index_copy_(1, slots, new[:, row : row + len(slots)])


def _prefills(out: torch.Tensor, query: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
              batch: StepBatch, scaling: float | None) -> None:
    """Each prefill chunk's rows of ``out``: causal over its sequence's slots."""
    for row, n, start, ctx in batch.prefills:
        if isinstance(ctx, int):  # one run: a view
            k, v = pk[None, :, ctx : ctx + start + n], pv[None, :, ctx : ctx + start + n]
        else:
            k, v = pk.index_select(1, ctx)[None], pv.index_select(1, ctx)[None]
        for a in range(0, n, QUERY_ROWS):  # bounds the mask: rows x context
            b = min(a + QUERY_ROWS, n)
            mask = torch.ones(b - a, start + b, dtype=torch.bool, device=query.device)
            o = sdpa(query[:, :, row + a : row + b], k[:, :, : start + b], v[:, :, : start + b],
                     attn_mask=mask.tril(start + a), scale=scaling, enable_gqa=True)
            out[row + a : row + b] = o[0].transpose(0, 1)


def _decodes(out: torch.Tensor, query: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
             batch: StepBatch, scaling: float | None) -> None:
    """Each decode's row of ``out`` (``query`` ``[T, heads, dim]``): a view of its one-run
    context, else the gathered padded batch. A query's heads become ``[kv_heads, group]``."""
    heads, kv_heads, dim = query.shape[1], pk.shape[0], query.shape[2]
    group = heads // kv_heads
    for row, first, n in batch.decode_views:
        q = query[row].view(1, kv_heads, group, dim)
        o = sdpa(q, pk[None, :, first : first + n], pv[None, :, first : first + n],
                 scale=scaling)
        out[row] = o.view(heads, dim)
    if batch.decode_rows is None:
        return
    assert batch.decode_slots is not None and batch.decode_mask is not None
    n_dec, lmax = batch.decode_slots.shape
    flat = batch.decode_slots.reshape(-1)
    k = pk.index_select(1, flat).view(kv_heads, n_dec, lmax, dim).transpose(0, 1)
    v = pv.index_select(1, flat).view(kv_heads, n_dec, lmax, dim).transpose(0, 1)
    q = query[batch.decode_rows].reshape(n_dec, kv_heads, group, dim)
    o = sdpa(q, k, v, attn_mask=batch.decode_mask, scale=scaling)  # [B, kv_heads, group, dim]
    out[batch.decode_rows] = o.reshape(n_dec, heads, dim)


def _dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """Plain causal attention, queries aligned to the end of the keys (a KV cache's layout)."""
    n, total = query.shape[2], key.shape[2]
    if mask is None:
        mask = torch.ones(n, total, dtype=torch.bool, device=query.device).tril(total - n)
    o = sdpa(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
    return o.transpose(1, 2).contiguous()


AttentionInterface.register(ATTENTION, paged_attention)
