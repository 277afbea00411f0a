"""Routing policies: rank the nodes that could serve a request, from one node's local view.

Theory of operation
-------------------
The router is a pure function of a :class:`RouteInput` (the request's size) and one
:class:`NodeInfo` per node (self included) describing what the deciding node *believes*: how
many of the request's tokens that node has cached, whether it is available (alive and not
pushing back), its forward round-trip, queue depth and speed. It returns a ranked list of
:class:`Candidate` — the head is the choice, the rest is the fallback order. Self is always in
the list, so local execution is always a fallback.

Policies
    ``none``          always self, claiming no cache hit (the paper's no-routing baseline).
    ``paper``         Algorithm 1: argmax estimated prefix match; ties go to self, then to the
                      lowest node id (the paper's argmax); suspect/pushed-back peers skipped.
    ``cost``          argmin of what each choice costs the mesh, with hysteresis, bounded
                      load, placement of prefixes on a ring, hot-prefix replicas and ski
                      rental: ``core/cost_policy.py`` (its rules and their evidence).
    ``random``, ``round_robin``, ``least_loaded``  baselines over available nodes.
    ``llmd``          llm-d's default scheduling profile run by every node on its own view
                      (``core/scorer.py``): prefix 3 : queue 2 : KV utilization 2.

The parts, by concern::

    router_config.py  Policy, RouterConfig     the policy and its knobs
    cost_model.py     NodeInfo, Candidate, ... what a request costs on a node (predictions)
    cost_policy.py    CostPolicy               the cost policy's ranking
    router.py         Router                   the policy dispatch and the baselines

This module re-exports the names the rest of the project imports from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.cost_model import (
    DELIBERATE,
    Candidate,
    NodeInfo,
    Placement,
    RouteInput,
    Tag,
    candidate,
    mesh_cost,
    predict_latency,
    predict_service,
    predict_ttft,
    predict_wait,
    robust_speeds,
)
from radixmesh.core.cost_policy import CostPolicy
from radixmesh.core.load_bound import mean_utilization, over_bound, request_slack
from radixmesh.core.router_config import Policy, RouterConfig
from radixmesh.core.scorer import llmd_order

__all__ = [
    "DELIBERATE",
    "Candidate",
    "NodeInfo",
    "Placement",
    "Policy",
    "RouteInput",
    "Router",
    "RouterConfig",
    "Tag",
    "mean_utilization",
    "mesh_cost",
    "over_bound",
    "predict_latency",
    "predict_service",
    "predict_wait",
    "request_slack",
]


class Router:
    """Ranks candidates under one policy; holds only the round-robin cursor."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._rr = 0
        self._cost = CostPolicy(config)

    def rank(
        self,
        req: RouteInput,
        nodes: Sequence[NodeInfo],
        rng: Random,
        placement: Placement | None = None,
    ) -> list[Candidate]:
        """Rank ``nodes`` (exactly one is self); ``placement``: the prefix's owner set."""
        selves = [n for n in nodes if n.is_self]
        if len(selves) != 1:
            raise ValueError("exactly one NodeInfo must be is_self")
        avail = [n for n in nodes if n.available]
        policy = self.config.policy
        if policy is Policy.COST:
            avail = robust_speeds(avail, self.config.speed_tolerance)
            return self._cost.rank(req, nodes, avail, rng, placement)
        if policy is Policy.NONE:
            # No view is consulted, so no cache hit is claimed (the paper's no-route baseline).
            me = selves[0]
            latency = predict_latency(req, me, self.config.context_scale)
            ttft = predict_ttft(req, me, self.config.context_scale)
            return [Candidate(me.node_id, True, 0, latency, ttft_s=ttft)]
        if policy is Policy.PAPER:
            order = _by_match(avail)
        elif policy is Policy.LLMD:
            order = llmd_order(req, avail, rng)
        elif policy is Policy.RANDOM:
            order = avail[:]
            rng.shuffle(order)
        elif policy is Policy.ROUND_ROBIN:
            order = self._round_robin(avail)
        else:
            order = _least_loaded(avail, rng)
        return [candidate(req, n, self.config.context_scale) for n in order]

    def _round_robin(self, avail: list[NodeInfo]) -> list[NodeInfo]:
        ordered = sorted(avail, key=lambda n: n.node_id)
        start = self._rr % len(ordered)
        self._rr += 1
        return ordered[start:] + ordered[:start]


def _by_match(avail: list[NodeInfo]) -> list[NodeInfo]:
    return sorted(avail, key=lambda n: (-n.cached_tokens, not n.is_self, n.node_id))


def _least_loaded(avail: list[NodeInfo], rng: Random) -> list[NodeInfo]:
    keyed = [(n.queue_depth, not n.is_self, rng.random(), n) for n in avail]
    keyed.sort(key=lambda k: k[:3])
    return [k[3] for k in keyed]
