"""llm-d's default scheduling profile as a routing policy (``llmd``): a baseline, not ours.

Theory of operation
-------------------
llm-d's inference scheduler (the Gateway API Inference Extension's endpoint picker) ranks
endpoints by a weighted sum of scorers, each in [0, 1], and picks the highest. Its default
profile (``default-plugins.yaml`` of llm-d's EPP, read Dec 2026) weighs

    prefix-cache-scorer 3 : queue-scorer 2 : kv-cache-utilization-scorer 2

with, per endpoint (gateway-api-inference-extension ``pkg/epp/scheduling/framework/plugins``):

* prefix: the share of the request's prompt found cached there (its blocks matched / blocks);
* queue: ``(max_q - q) / (max_q - min_q)`` over the candidates' waiting queues, 1 for all when
  they are equal (``queuescorer/queue.go``);
* KV utilization: ``1 - kv_cache_usage`` (``kvcacheutilizationscorer``).

Here each node runs it on its own view, as every other policy: cached prefixes from the peer
view (exact for itself), queue depths as the loads reported them (aged as for ``cost``), KV
usage as cache tokens over budget. A node's queue depth counts its requests waiting *and*
running (it sees an external engine's requests in flight, not the engine's own split), where
llm-d's queue scorer reads vLLM's waiting count: scoring the waiting count alone (always 0
on an H100 profile's 1,024-sequence batch) made this policy pile requests on prefix holders,
0.64 → 0.93× `none`'s mean TTFT on 16 emulated H100s (docs/ideas-tried.md). Ties go in
random order (the max-score picker's shuffle).
It is the baseline the regime issue asks for: a load + prefix heuristic with the weights
people deploy, judged on the same engines as ``cost``.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.cost_model import NodeInfo, RouteInput

PREFIX_WEIGHT = 3.0
QUEUE_WEIGHT = 2.0
KV_WEIGHT = 2.0


def llmd_scores(req: RouteInput, nodes: Sequence[NodeInfo]) -> list[float]:
    """Each node's weighted score (higher is better), in ``nodes``' order."""
    queues = [n.queue_depth for n in nodes]
    lo, hi = (min(queues), max(queues)) if queues else (0.0, 0.0)
    prompt = max(req.prompt_tokens, 1)
    out = []
    for n in nodes:
        prefix = min(n.cached_tokens / prompt, 1.0)
        queue = 1.0 if hi == lo else (hi - n.queue_depth) / (hi - lo)
        kv = 1.0 - min(max(n.kv_usage, 0.0), 1.0)
        out.append(PREFIX_WEIGHT * prefix + QUEUE_WEIGHT * queue + KV_WEIGHT * kv)
    return out


def llmd_order(req: RouteInput, nodes: Sequence[NodeInfo], rng: Random) -> list[NodeInfo]:
    """``nodes`` best first under the llm-d profile; ties in random order."""
    scores = llmd_scores(req, nodes)
    keyed = sorted(zip(scores, [rng.random() for _ in nodes], range(len(nodes)), strict=True),
                   key=lambda k: (-k[0], k[1]))
    return [nodes[k[2]] for k in keyed]
