"""Two choices among equivalent holders: what keeps many routers from herding on old reports.

Every node ranks the peers holding a request's prefix by their gossiped load, a report up to
a round old. With a few routers the least loaded of them is the right pick; with 63 routers
sharing the same aged reports they all pick the same one, and the load swings (64 simulated
H100s, RAG at 80 %: 47-148 requests a node against the gateway's 88-112). The remedy is
Mitzenmacher's ("How useful is old information?", 2000): on stale loads, the best of two
random choices beats the best of many. Only among *equivalent* holders, though: the same
cached depth, the same engine speed and the same network distance; a faster engine or a
nearer holder is a real difference, never dropped for randomness (two random holders of a
mixed mesh's hot prefix often missed every H100).

At 64 simulated H100s (delta gossip, RAG at 80 %) 30.0 / 65.5 ms mean / p99 TTFT → 26.9 / 56.8
(the gateway model 27.2 / 72.7); at 16 nodes every regime and workload within about 2 % of the
mean. :func:`two_choices` keeps at most ``per_class`` (``RouterConfig.holder_choices``) random
peers of each class of holders (peers holding none of the prompt are left as they are). Pure;
the caller's seeded ``Random``.
"""

from __future__ import annotations

import math
from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.cost_model import NodeInfo


def holder_class(n: NodeInfo) -> tuple[object, ...]:
    """What makes two holders equivalent: cached tokens, the engine's step coefficients
    (a batching engine's report; else the learnt speed, as gossiped), and the round trip's
    octave (1 ms, 2 ms, 4 ms ...: jitter within a region stays in one class)."""
    b = n.batch
    speed: tuple[float, ...] = (
        (b.step_base_s, b.prefill_token_s, b.decode_seq_s) if b is not None
        else (n.speed.prefill_s_per_token, n.speed.decode_s_per_token))
    octave = round(math.log2(max(n.rtt_s, 1e-4) / 1e-3))
    return (n.cached_tokens, speed, octave)


def two_choices(peers: list[NodeInfo], rng: Random, per_class: int) -> list[NodeInfo]:
    """``peers`` with at most ``per_class`` random holders of each class (order kept; the
    list itself when nothing is dropped)."""
    if len(peers) <= per_class:
        return peers
    classes: dict[tuple[object, ...], list[int]] = {}
    for i, n in enumerate(peers):
        if n.cached_tokens > 0:
            classes.setdefault(holder_class(n), []).append(i)
    drop: set[int] = set()
    for members in classes.values():
        if len(members) > per_class:
            keep = set(rng.sample(members, per_class))
            drop.update(i for i in members if i not in keep)
    return [n for i, n in enumerate(peers) if i not in drop] if drop else peers
