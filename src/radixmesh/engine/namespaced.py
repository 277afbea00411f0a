"""Cache namespaces on the built-in engine: the scheduler's positions against the model's.

Theory of operation
-------------------
The core scheduler runs a namespaced request (a tenant, a ``cache_salt``, a LoRA adapter:
``core/tenants.py``) as its namespace's *virtual block* followed by its prompt
(``Scheduler.add(..., namespace=)``, ``core/blocks.NamespaceHeads``): its prefix tree keeps the
namespaces apart, and the hashes of the real blocks after the virtual one are the mesh's
namespaced hashes (``block_hashes(prompt, bs, namespace_seed(...))``). The model never sees
that block: it has no token ids a model knows, no positions and no KV. So the runner executes
each step in *model positions* (:func:`model_step`): every prefill chunk and decode slot of a
sequence with ``hidden`` virtual tokens in front moves back by ``hidden``, and a chunk lying
wholly inside the virtual block computes nothing and is dropped (it is never a prompt's last
chunk: a prompt has at least one real token). The paged KV tables (``engine/paged_kv.py``)
are in model positions too, keyed by the real blocks' hashes chained from the namespace's seed
(:func:`sequence_seed`); the virtual block's hash is left out of the scheduler's journal
(``Scheduler.drain_cache_delta``, ``Scheduler.cache_hashes``), so no physical block ever
stands for it and the node's index sees only real blocks.

Costs: the scheduler counts a cached namespace's virtual block as one KV block of its pool
(a physical block is never allocated for it: the pool is that much less full than counted),
and the request that first computes a namespace's block has its ``block_size`` virtual tokens
charged to the step's token budget. ``cached_tokens`` leaves them out (``Finished``).

An adapter's KV is its own because the node puts the adapter's content digest in the
namespace (``Namespacer.namespace_id``); a request naming an adapter but no namespace (the
engine used directly) gets the namespace :func:`effective_namespace` derives from the name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from radixmesh.core.blocks import namespace_seed
from radixmesh.core.scheduler import DecodeSlot, PrefillChunk, SeqId, Step
from radixmesh.engine.base import GenerateRequest


class Hidden(Protocol):
    hidden: int  # virtual tokens in front of the sequence (0: not namespaced)


def effective_namespace(req: GenerateRequest) -> str | None:
    """The namespace ``req`` runs in: its own, else (an adapter without one) the adapter's."""
    if req.cache_namespace is None and req.adapter is not None:
        return f"adapter:{req.adapter}"
    return req.cache_namespace


def sequence_seed(base_seed: int, namespace: str | None, block_size: int) -> int:
    """The seed of the chain of a sequence's real blocks (``core/blocks.namespace_seed``)."""
    return namespace_seed(base_seed, namespace, block_size)


def model_step(step: Step, live: Mapping[SeqId, Hidden]) -> Step:
    """``step`` in model positions (module docstring); ``step`` itself when nothing in it is
    namespaced."""
    if not any(live[c.seq].hidden for c in step.prefills) and not any(
            live[d.seq].hidden for d in step.decodes):
        return step
    prefills = []
    for c in step.prefills:
        h = live[c.seq].hidden
        start = max(c.start, h)
        n = c.start + c.tokens - start
        if n > 0:
            prefills.append(PrefillChunk(c.seq, start - h, n, c.last))
    decodes = tuple(DecodeSlot(d.seq, d.context - live[d.seq].hidden) for d in step.decodes)
    return Step(tuple(prefills), decodes, step.preempted)
