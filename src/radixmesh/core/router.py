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
    ``cost``          argmin predicted latency = rtt + queue wait + prefill(uncached) + decode.
                      A peer must beat self by ``min_gain_s`` and ``min_gain_frac`` (hysteresis
                      against noisy estimates). Equal predictions keep self first, and ties
                      among peers are broken by load, then at random — never "the first peer".
                      *Bounded load*: a peer whose gossiped utilization exceeds
                      ``(1 + load_bound)`` × the mean utilization of the available nodes
                      (default 1.5×) takes no forwards (it stays in the fallback order).
                      Affinity alone makes the first node to cache a popular prefix a
                      hotspot even when queues are empty (one client, the paper's schedule);
                      with the bound, the overflow is served where it enters, that node caches
                      the prefix too, and hot prefixes end up replicated on as many nodes as
                      their traffic needs. The bound yields to a large certain saving: a peer
                      over it that still has room (utilization < 0.5) and is predicted to
                      answer in under half the time of the best peer within it (a long cached
                      prefix) still gets the request — at low load, balancing must not throw
                      away certain hits.
                      *Placement*: a prefix nobody holds (as far as the deciding node can
                      tell) goes to its owner on a consistent-hashing ring of the routable
                      members (``core/placement.py``) when that costs at most 25 % more now,
                      so every entry node sends the same new prefix to the same node (no
                      second cold copy) and new prefixes spread over all nodes.
                      *Robust speeds*: learnt speeds within ``speed_tolerance`` (1.5×) of the
                      candidates' median count as the median, so that estimation noise on a
                      shared machine cannot send cold requests to whichever node looks fastest
                      (positive feedback: that node caches the new prefix, the others never do).
    ``random``, ``round_robin``, ``least_loaded``  baselines over available nodes.

Because a peer's prediction includes its forward RTT, ``cost`` forwards only when the predicted
saving exceeds the forward cost: on a slow network it degenerates to ``none``. Its peer
candidates carry ``beat_s`` (local prediction − RTT): the peer checks it against its exact queue
and cache and refuses the forward when it cannot beat it, so a view of the peer's queue that
is a gossip round old costs one round trip, not a long wait in a queue that many nodes chose
at once.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.estimators import SpeedReport


class Policy(StrEnum):
    NONE = "none"
    PAPER = "paper"
    COST = "cost"
    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"

    @classmethod
    def parse(cls, text: str) -> Policy:
        try:
            return cls(text.strip().lower())
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown routing policy {text!r} (choose from {names})") from None


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: Policy = Policy.COST
    min_gain_s: float = 0.001  # a forward must be predicted to save at least this (seconds)
    min_gain_frac: float = 0.1  # ... and at least this fraction of the local prediction
    context_scale: float = 4096.0  # see estimators.prefill_work
    load_bound: float | None = 0.5  # cost: no forwards to peers above (1+x) × mean utilization
    load_window_s: float = 10.0  # utilization is measured over about this many seconds
    # cost: a peer over the load bound still takes a forward it is predicted to answer in
    # less than (1 - x) of the time of the best peer within the bound (1: never)
    load_bound_bypass: float = 0.5
    load_bound_floor: float = 0.5  # ... if its utilization is below this (it has room)
    # cost: a prefix nobody holds goes to its owner on the consistent-hashing ring (every
    # entry node picks the same one: no second cold copy), named by the block at this depth
    # (None: off) ...
    placement_depth_blocks: int | None = 16
    placement_slack: float = 0.25  # ... when the owner is predicted at most this much slower
    # cost: a node's learnt speed within this factor of the median of the candidates counts
    # as the median (noise on a shared machine must not pull cold traffic to whichever node
    # looks fastest); None = use every estimate as it is
    speed_tolerance: float | None = 1.5

    def __post_init__(self) -> None:
        if self.min_gain_s < 0 or not 0 <= self.min_gain_frac < 1:
            raise ValueError("min_gain_s must be >= 0 and min_gain_frac in [0, 1)")
        if self.load_bound is not None and self.load_bound < 0:
            raise ValueError("load_bound must be >= 0 (or None to disable)")
        if self.placement_depth_blocks is not None and self.placement_depth_blocks < 1:
            raise ValueError("placement_depth_blocks must be >= 1 (or None)")
        if self.placement_slack < 0:
            raise ValueError("placement_slack must be >= 0")
        if not 0 <= self.load_bound_bypass <= 1 or not 0 <= self.load_bound_floor <= 1:
            raise ValueError("load_bound_bypass and load_bound_floor must be in [0, 1]")
        if self.load_window_s <= 0:
            raise ValueError("load_window_s must be > 0")
        if self.context_scale <= 0:
            raise ValueError("context_scale must be > 0")
        if self.speed_tolerance is not None and self.speed_tolerance < 1:
            raise ValueError("speed_tolerance must be >= 1 (or None to disable)")


@dataclass(frozen=True, slots=True)
class RouteInput:
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What the deciding node believes about one node (itself included)."""

    node_id: str
    is_self: bool
    cached_tokens: int  # estimated cached prefix of this request (exact for self)
    rtt_s: float  # forward round-trip overhead; 0 for self
    queue_depth: int  # requests waiting or running, as the node itself reported
    speed: SpeedReport
    suspect: bool = False
    pushed_back: bool = False
    utilization: float = 0.0  # recent busy fraction in [0, 1], as the node itself measured it

    @property
    def available(self) -> bool:
        return self.is_self or not (self.suspect or self.pushed_back)


@dataclass(frozen=True, slots=True)
class Candidate:
    node_id: str
    is_self: bool
    expected_cached_tokens: int
    predicted_latency_s: float
    # cost policy, peers only: the queue wait + service the peer must beat for the forward to
    # pay (our local prediction minus the forward's RTT). Sent with the forward; the peer,
    # which knows its queue and cache exactly, refuses it if it cannot (``RefuseForward``).
    beat_s: float | None = None


def predict_latency(req: RouteInput, node: NodeInfo, context_scale: float) -> float:
    cached = min(node.cached_tokens, max(0, req.prompt_tokens - 1))
    uncached = req.prompt_tokens - cached
    service = node.speed.service_s(uncached, cached, req.max_tokens, context_scale)
    wait = node.queue_depth * node.speed.mean_service_s
    return (0.0 if node.is_self else node.rtt_s) + wait + service


class Router:
    """Ranks candidates under one policy; holds only the round-robin cursor."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._rr = 0

    def rank(
        self, req: RouteInput, nodes: Sequence[NodeInfo], rng: Random, owner: str | None = None
    ) -> list[Candidate]:
        """Rank ``nodes`` (exactly one is self); ``owner``: a cold prefix's placement owner."""
        selves = [n for n in nodes if n.is_self]
        if len(selves) != 1:
            raise ValueError("exactly one NodeInfo must be is_self")
        avail = [n for n in nodes if n.available]
        policy = self.config.policy
        if policy is Policy.COST:
            avail = self._robust_speeds(avail)
            selves = [n for n in avail if n.is_self]
        if policy is Policy.NONE:
            # No view is consulted, so no cache hit is claimed (the paper's no-route baseline).
            me = selves[0]
            latency = predict_latency(req, me, self.config.context_scale)
            return [Candidate(me.node_id, True, 0, latency)]
        if policy is Policy.PAPER:
            order = _by_match(avail)
        elif policy is Policy.COST:
            order = self._by_cost(req, avail, rng, owner)
        elif policy is Policy.RANDOM:
            order = avail[:]
            rng.shuffle(order)
        elif policy is Policy.ROUND_ROBIN:
            order = self._round_robin(avail)
        else:
            order = _least_loaded(avail, rng)
        if policy is not Policy.COST:
            return [self._candidate(req, n) for n in order]
        local = predict_latency(req, selves[0], self.config.context_scale)
        placed = local * (1.0 + self.config.placement_slack)
        return [
            self._candidate(
                req, n, None if n.is_self else (placed if n.node_id == owner else local) - n.rtt_s
            )
            for n in order
        ]

    def _robust_speeds(self, avail: list[NodeInfo]) -> list[NodeInfo]:
        """Speeds within ``speed_tolerance`` of the candidates' median are the median: only a
        difference larger than measurement noise (another GPU, a throttled node) counts."""
        tol = self.config.speed_tolerance
        if tol is None or len(avail) < 2:
            return avail
        median = _median_speed([n.speed for n in avail])
        return [replace(n, speed=_snapped(n.speed, median, tol)) for n in avail]

    # ---------------------------------------------------------------------------- policies
    def _by_cost(
        self,
        req: RouteInput,
        avail: list[NodeInfo],
        rng: Random,
        owner: str | None = None,
    ) -> list[NodeInfo]:
        scale = self.config.context_scale
        keyed = [(predict_latency(req, n, scale), n.queue_depth, rng.random(), n) for n in avail]
        keyed.sort(key=lambda k: (k[0], not k[3].is_self, k[1], k[2]))
        order = [k[3] for k in keyed]
        overloaded = self._over_bound(avail)
        mine = next(k for k in keyed if k[3].is_self)
        best = next((k for k in keyed if k[3].node_id not in overloaded), mine)
        if self._bypasses_bound(keyed[0], best):
            best = keyed[0]  # a large certain saving (a long cached prefix) beats balancing
        needed = max(self.config.min_gain_s, self.config.min_gain_frac * mine[0])
        if mine[0] - best[0] < needed:
            best = mine
        best = self._placed(keyed, best, owner, overloaded)
        return [best[3], *(n for n in order if n is not best[3])]

    def _placed(
        self,
        keyed: list[tuple[float, int, float, NodeInfo]],
        best: tuple[float, int, float, NodeInfo],
        owner: str | None,
        overloaded: set[str],
    ) -> tuple[float, int, float, NodeInfo]:
        """A cold prefix goes to its owner if that costs at most ``placement_slack`` now."""
        if owner is None or owner in overloaded:
            return best
        entry = next((k for k in keyed if k[3].node_id == owner), None)
        if entry is None or entry[0] > (1.0 + self.config.placement_slack) * best[0]:
            return best  # the owner is busy or slow now: the fastest choice wins
        return entry

    def _bypasses_bound(
        self, top: tuple[float, int, float, NodeInfo], best: tuple[float, int, float, NodeInfo]
    ) -> bool:
        """Whether the fastest candidate, over the load bound, gets the request anyway: it has
        room (utilization under ``load_bound_floor``) and saves most of the time."""
        cfg = self.config
        return (
            top[3].utilization < cfg.load_bound_floor
            and top[0] < (1.0 - cfg.load_bound_bypass) * best[0]
        )

    def _over_bound(self, avail: list[NodeInfo]) -> set[str]:
        """Peers whose utilization exceeds ``(1 + load_bound)`` × the mean (bounded load)."""
        bound = self.config.load_bound
        if bound is None or len(avail) < 2:
            return set()
        mean = sum(n.utilization for n in avail) / len(avail)
        if mean <= 0.0:
            return set()
        limit = (1.0 + bound) * mean
        window = self.config.load_window_s
        # Slack of one request's worth of busy time: with light traffic (a single node active)
        # the mean is tiny, and a node must still be able to take the next request.
        return {
            n.node_id
            for n in avail
            if not n.is_self and n.utilization > limit + n.speed.mean_service_s / window
        }

    def _round_robin(self, avail: list[NodeInfo]) -> list[NodeInfo]:
        ordered = sorted(avail, key=lambda n: n.node_id)
        start = self._rr % len(ordered)
        self._rr += 1
        return ordered[start:] + ordered[:start]

    def _candidate(self, req: RouteInput, node: NodeInfo, beat_s: float | None = None) -> Candidate:
        expected = min(node.cached_tokens, req.prompt_tokens)
        return Candidate(
            node_id=node.node_id,
            is_self=node.is_self,
            expected_cached_tokens=expected,
            predicted_latency_s=predict_latency(req, node, self.config.context_scale),
            beat_s=beat_s,
        )


# The hardware's speed; not ``mean_service_s``, which follows the node's own mix of cached and
# cold requests (it prices that node's queue) and really differs between nodes.
_SPEED_FIELDS = ("prefill_overhead_s", "prefill_s_per_token", "decode_s_per_token")


def _median_speed(speeds: list[SpeedReport]) -> dict[str, float]:
    return {f: statistics.median(getattr(s, f) for s in speeds) for f in _SPEED_FIELDS}


def _snapped(speed: SpeedReport, median: dict[str, float], tol: float) -> SpeedReport:
    snapped = {}
    for f, mid in median.items():
        mine = getattr(speed, f)
        snapped[f] = mid if mid / tol <= mine <= mid * tol else mine
    return replace(speed, **snapped)


def _by_match(avail: list[NodeInfo]) -> list[NodeInfo]:
    return sorted(avail, key=lambda n: (-n.cached_tokens, not n.is_self, n.node_id))


def _least_loaded(avail: list[NodeInfo], rng: Random) -> list[NodeInfo]:
    keyed = [(n.queue_depth, not n.is_self, rng.random(), n) for n in avail]
    keyed.sort(key=lambda k: k[:3])
    return [k[3] for k in keyed]
