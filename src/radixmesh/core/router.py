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
    ``cost``          argmin predicted latency = rtt + queue wait + prefill(uncached) + decode,
                      plus, under load, what the choice costs the requests queued behind it
                      and those that will arrive while it runs (:func:`mesh_cost`: the
                      candidate's service once more for each request queued there, and half
                      of it for each one expected to arrive during it, at the rate the
                      candidate serves requests). A peer must
                      beat self by ``min_gain_s`` and ``min_gain_frac`` of the local work
                      (hysteresis against noisy speed estimates). Equal
                      predictions keep self first, and ties among peers are broken by load,
                      then at random — never "the first peer".
                      *Bounded load*: a peer whose gossiped utilization exceeds
                      ``(1 + load_bound)`` × the mean utilization of the available nodes
                      (default 1.5×) takes no forwards (it stays in the fallback order).
                      Affinity alone makes the first node to cache a popular prefix a
                      hotspot even when queues are empty (one client, the paper's schedule);
                      with the bound, the overflow is served where it enters, that node caches
                      the prefix too, and hot prefixes end up replicated on as many nodes as
                      their traffic needs. The bound yields to a peer with room: one over
                      it that has room (utilization < 0.5, or no queue expected when the
                      request arrives) and is predicted to answer fastest still gets the
                      request — where nothing queues, balancing buys no time and must not
                      throw away hits (``load_bound_bypass`` can ask for a larger saving).
                      *Placement and replicas* (``core/placement.py``): each request's prefix
                      has an *owner set* on a consistent-hashing ring of the routable members
                      — one owner for a cold or lukewarm prefix, as many as its measured load
                      needs for a hot one. The preferred candidates are the owners and the
                      nodes that hold the prefix; the best of them (near-equal ones picked at
                      random, self first: two entry nodes with the same stale view do not
                      pick the same peer) wins when it is predicted at most
                      ``placement_slack`` (75 %) slower than the best choice now (an
                      owner making the first copy: 75 % of that copy's work slower), if
                      that choice would copy the prefix or holds less of the request (by
                      more than the hysteresis is worth). A member busier than
                      ``(1 + placement_load_bound)`` × the mean utilization (1.15×, tighter
                      than ``load_bound``) is passed over on the ring, self included:
                      it keeps the prefixes it holds, and new ones go to the next member
                      clockwise (consistent hashing with bounded load; the ring's arcs and
                      the prefixes' popularity are uneven: on the real cluster one node of
                      four owned 30 % of the ring and served 40 % of MMLU's requests). A peer is
                      preferred only if a later request entering elsewhere would gain at
                      least a round trip by using its copy (else nobody would be forwarded
                      to it: over a slow link every node keeping its own copy wins). So every
                      entry node sends a new prefix to the same node (no second cold copy),
                      new prefixes spread over all nodes, and a hot prefix's overflow goes to
                      the next owner on the ring — a deliberate replica — instead of a cold
                      copy wherever it entered. Each candidate is tagged (``placement``: hit,
                      first copy, deliberate replica, second copy, unplaced, local copy) so
                      the node can count what its decisions cost.
                      *Ski rental*: a forward to a holder rents its copy for one round trip,
                      plus the queue wait it met there beyond the one this node predicted for
                      itself (signed: a holder no busier than this node costs nothing on
                      average; the rent never goes below 0); a copy here costs, once, what
                      staying costs more than forwarding now (never less than the extra
                      service it makes here, less that round trip; a forward the slack chose,
                      slower than staying, is no rental). The node sums that rent per prefix
                      (``rent_s``) and keeps the request here (tag ``local_copy``) once it
                      reaches the price: after ~75 forwards of a prefix to an idle holder over
                      a 4 ms link, at the first or second over a 400 ms one, after a few to a
                      holder where each waits 0.1 s.
                      *Its own queue, by its tokens*: the deciding node knows what its queued
                      requests will compute (their uncached tokens, ``LoadChanged``), so each
                      place in its own queue is priced at that (``NodeInfo.queue_service_s``),
                      here and in the refusal check; at depth × mean service a queue of cold
                      prefills behind mostly warm traffic looked half as long as it was. A
                      peer's queue stays at its mean service: gossiping the price was tried,
                      and a report prices a queue that is gone when the forward lands.
                      *Stale queues*: per peer, the node learns how far its predictions of the
                      peer's queue wait were off, from the waits its forwards met there
                      (``wait_error_s``); a forward must save more than that too.
                      *Robust speeds*: learnt speeds within ``speed_tolerance`` (1.5×) of the
                      candidates' median (a prefill line judged by its times at a warm step's
                      and a cold prompt's size) count as the median, so that estimation noise on a
                      shared machine cannot send cold requests to whichever node looks fastest
                      (positive feedback: that node caches the new prefix, the others never do).
                      A speed far off the median for lack of recent requests is not noise
                      the tolerance can absorb: the node restarts it (``NodeCore``).
    ``random``, ``round_robin``, ``least_loaded``  baselines over available nodes.

Because a peer's prediction includes its forward RTT, ``cost`` forwards only when the predicted
saving exceeds the forward cost: on a slow network it degenerates to ``none``. Its peer
candidates carry ``beat_s``: the peer checks it against its exact queue and cache and refuses
the forward when it cannot beat it, so a view of the peer's queue that is a gossip round old
costs one round trip, not a long wait in a queue that many nodes chose at once. Such a
refusal says the peer's queue wait, which the sender takes as a fresh report of that queue;
it does not back off from the peer (it is not busy as such, and a holder that refused a
cold request must stay a candidate for the hits it holds). ``beat_s`` is
what staying costs (the local prediction, plus the local miss's extra work × the local queue
under load; × ``1 + placement_slack`` for a preferred holder, + ``placement_slack`` × the
copy's work for an owner making the first copy), *not* minus the RTT: when
the forward arrives, its way out is spent, and the way back is paid whether the peer answers
the request or refuses it — so the peer should take it whenever its wait + service beats what
the sender would do instead. (Subtracting the RTT refused forwards
that still paid: at 16–1,024 simulated nodes 0.4–0.5 refusals per request.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from random import Random  # the type only: instances are passed in, never the global one

from radixmesh.core.estimators import SpeedReport, median_speed, prefill_times
from radixmesh.core.units import parse_choice


class Policy(StrEnum):
    NONE = "none"
    PAPER = "paper"
    COST = "cost"
    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"

    @classmethod
    def parse(cls, text: str) -> Policy:
        return parse_choice(cls, text, "routing policy")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: Policy = Policy.COST
    min_gain_s: float = 0.001  # a forward must be predicted to save at least this (seconds)
    min_gain_frac: float = 0.1  # ... and at least this fraction of the local prediction
    context_scale: float = 4096.0  # see estimators.prefill_work
    load_bound: float | None = 0.5  # cost: no forwards to peers above (1+x) × mean utilization
    load_window_s: float = 10.0  # utilization is measured over about this many seconds
    # cost: a peer over the load bound still takes a forward it is predicted to answer in
    # less than (1 - x) of the time of the best peer within the bound (1: never; 0: whenever
    # it is the fastest)
    load_bound_bypass: float = 0.0
    # ... if it has room: its utilization is below this, or no queue is expected there
    load_bound_floor: float = 0.5
    # cost: a prefix has an owner set on the consistent-hashing ring (every entry node picks
    # the same: no second cold copy), named by the block at this depth (None: off) ...
    placement_depth_blocks: int | None = 16
    # ... and a prefix's holders are preferred while predicted at most this fraction slower
    # than the best choice now (the copy they avoid would cost every later request), an
    # owner making the first copy while at most this fraction of that copy's work slower
    placement_slack: float = 0.75
    # ... and a member busier than (1+x) × the mean utilization is passed over on the ring:
    # no prefix gets it as a new owner (consistent hashing with bounded load; None: off)
    placement_load_bound: float | None = 0.15
    # cost: a hot prefix gets ceil(load / replica_load) owners (load: node-seconds of service
    # per second its requests need, estimated from this node's traffic), at most max_replicas
    replica_load: float = 0.5
    max_replicas: int = 64
    replica_window_s: float = 10.0  # the time constant of a prefix's measured request rate
    # cost: the time constant of the rent a node remembers paying for a prefix's copy
    # elsewhere (see Placement.rent_s)
    rent_window_s: float = 600.0
    # cost: the time constant of a peer's measured queue-wait prediction error (WaitError)
    error_window_s: float = 10.0
    # cost: preferred candidates (owners, holders) within this fraction (and min_gain_s) of the
    # best of them are equal; one is picked at random (self first)
    near_tie: float = 0.1
    # a peer's reported queue says little after this many of its mean service times (others
    # send to it meanwhile): the deciding node then expects the mesh's mean queue instead
    queue_memory: float = 2.0
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
        if self.placement_load_bound is not None and self.placement_load_bound < 0:
            raise ValueError("placement_load_bound must be >= 0 (or None to disable)")
        if not 0 <= self.load_bound_bypass <= 1 or not 0 <= self.load_bound_floor <= 1:
            raise ValueError("load_bound_bypass and load_bound_floor must be in [0, 1]")
        if self.load_window_s <= 0:
            raise ValueError("load_window_s must be > 0")
        if self.context_scale <= 0:
            raise ValueError("context_scale must be > 0")
        if self.speed_tolerance is not None and self.speed_tolerance < 1:
            raise ValueError("speed_tolerance must be >= 1 (or None to disable)")
        if self.rent_window_s <= 0 or self.error_window_s <= 0:
            raise ValueError("rent_window_s and error_window_s must be > 0")
        if self.replica_load <= 0 or self.max_replicas < 1 or self.replica_window_s <= 0:
            raise ValueError("replica_load and replica_window_s must be > 0, max_replicas >= 1")
        if self.near_tie < 0 or self.queue_memory <= 0:
            raise ValueError("near_tie must be >= 0 and queue_memory > 0")


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
    # requests waiting or running: exact for self; for a peer, what the deciding node expects
    # it to be when the request arrives (its report, aged, plus our forwards since)
    queue_depth: float
    speed: SpeedReport
    suspect: bool = False
    pushed_back: bool = False
    utilization: float = 0.0  # recent busy fraction in [0, 1], as the node itself measured it
    # how far the deciding node's predictions of this node's queue wait have lately been off
    # (``estimators.WaitError``: a peer's view is stale under bursty load); 0 for self
    wait_error_s: float = 0.0
    # what one place in its queue costs, from its queued requests' tokens (self only: its
    # exact queue; ``SpeedReport.queued_service_s``); None: the speed's mean service time
    queue_service_s: float | None = None

    @property
    def available(self) -> bool:
        return self.is_self or not (self.suspect or self.pushed_back)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the request's prefix should live (cost policy; see ``core/placement.py``)."""

    owners: tuple[str, ...]  # its owner set, in ring order (may include self)
    held_tokens: int  # a node whose cached prefix of the request is this long holds it
    # what renting this prefix's copy elsewhere recently cost this node (the forwards' round
    # trips and the waits they met beyond its own): when it reaches what a copy here costs
    # more than a forward now, a copy is made here instead
    rent_s: float = 0.0


class Tag(StrEnum):
    """What serving a request on a candidate does to its prefix's copies (cost policy)."""

    HIT = "hit"  # the candidate holds the prefix
    FIRST = "first"  # nobody holds it; the candidate is its owner: the one cold copy
    REPLICA = "replica"  # others hold it; the candidate is an owner: a deliberate replica
    SECOND_COPY = "second_copy"  # others hold it; not an owner: an accidental cold copy
    UNPLACED = "unplaced"  # nobody holds it; not an owner (placement gave way to load)
    # a peer holds it, this node does not; kept here because the round trips spent renting
    # that copy reached what a copy here costs (``Placement.rent_s``): a deliberate replica
    LOCAL_COPY = "local_copy"


# the tags of copies made on purpose (hot-prefix replicas, rented copies bought), as opposed
# to an accidental second copy
DELIBERATE = frozenset({Tag.REPLICA, Tag.LOCAL_COPY})


@dataclass(frozen=True, slots=True)
class Candidate:
    node_id: str
    is_self: bool
    expected_cached_tokens: int
    predicted_latency_s: float
    # cost policy, peers only: the queue wait + service the peer must beat for the forward to
    # pay (what staying here costs: see the module docstring). Sent with the forward; the peer,
    # which knows its queue and cache exactly, refuses it if it cannot (``RefuseForward``).
    beat_s: float | None = None
    placement: Tag | None = None  # cost policy with a placement only
    wait_s: float = 0.0  # the queue wait in ``predicted_latency_s`` (what a forward is checked
    #                      against when the peer reports the wait it met: ``WaitError``)
    # the placement key whose copy this forward rents (a hit there, not here, predicted faster
    # than staying; first ranking only): the wait it meets there beyond this node's own is
    # rent paid (``Placement.rent_s``)
    rent_key: int | None = None
    cost_s: float | None = None  # cost policy: its mesh cost (``mesh_cost``), what it ranks by


def predict_service(req: RouteInput, node: NodeInfo, context_scale: float) -> float:
    """The engine time the request would take on ``node`` (its uncached part prefilled)."""
    cached = min(node.cached_tokens, max(0, req.prompt_tokens - 1))
    uncached = req.prompt_tokens - cached
    return node.speed.service_s(uncached, cached, req.max_tokens, context_scale)


def predict_wait(node: NodeInfo) -> float:
    """The queue wait a request meets on ``node``: its queue, each place priced by what the
    queued requests will compute (else at the node's mean service time)."""
    per = node.speed.mean_service_s if node.queue_service_s is None else node.queue_service_s
    return node.queue_depth * per


def predict_latency(req: RouteInput, node: NodeInfo, context_scale: float) -> float:
    return _latency(node, predict_service(req, node, context_scale))


def _latency(node: NodeInfo, service_s: float) -> float:
    """Round trip (peers only) + queue wait + ``service_s``."""
    rtt = 0.0 if node.is_self else node.rtt_s
    return rtt + predict_wait(node) + service_s


def mesh_cost(req: RouteInput, nodes: Sequence[NodeInfo], context_scale: float) -> list[float]:
    """What sending the request to each node costs the mesh, not only the request: its predicted
    latency, plus the wait its service adds to the requests that will queue behind it there. A
    node's queue now is the sample of that (``queue_depth``: exact for this node, expected for a
    peer; in an M/M/1 queue the mean number behind a request is the mean number ahead of it), so
    each node's service is counted once more per request queued there. Nothing is queued when
    requests come one at a time (then, at an idle node, this *is* the predicted latency). Under
    load the queue-wait differences a node sees are a gossip round old, while the work a miss
    adds is paid by everyone after it: the selfish latency alone gave away cache hits as soon as
    queues formed (4-16 clients: `cost` hit rates near `none`'s, below the centralized
    gateways'). And a node with an empty queue computes a miss for free where a holder's queue
    makes everyone behind the forward wait: pricing every candidate's extra work by this node's
    queue alone (an earlier design) kept a node lacking the agentic system prompt forwarding its
    requests to busy holders while its engine idled (1.11x `none` on the real cluster at 80 %
    load, round-robin entry).

    That term stands for the requests arriving while this one waits, each of which waits for
    all of its service; those arriving while it is served wait for what is left of it, half
    on average, and a node's queue now does not show them (it is often empty at a busy
    node): a node serving ``utilization / mean_service_s`` requests per second (its
    utilization as gossiped: everyone's traffic there, not only this node's forwards) sees
    that rate × the service arrive meanwhile, so the service counts once more × that rate ×
    half of it: quadratic in the service. A hit of a few ms at a hot prefix's busy holder
    costs its stream next to nothing; a long prompt there holds up all of it (on the real
    cluster at 80 % load a 3,014-token request sent to the holder of the hot prefix queued
    the requests behind it 4-5 s), and a cold copy at a busy node likewise. With it the
    simulator's workload matrix cached 0.1-2.1 points more of the prompt tokens on the
    agentic, chat and RAG rows under load, and on one shared core its `cost`/`none` went
    0.730 -> 0.714 (geometric mean; docs/benchmarks.md "Router" -> "What a long request costs
    those arriving behind it")."""
    out = []
    for n in nodes:
        service = predict_service(req, n, context_scale)
        mean = n.speed.mean_service_s
        arrivals = n.utilization / mean if mean > 0.0 else 0.0  # requests/s it serves
        out.append(_latency(n, service) + service * n.queue_depth
                   + arrivals * service * service / 2.0)
    return out


def mean_utilization(nodes: Sequence[NodeInfo]) -> float:
    """The mean of the nodes' utilizations (0 for none): what bounded load compares to."""
    return sum(n.utilization for n in nodes) / len(nodes) if nodes else 0.0


def over_bound(node: NodeInfo, mean: float, bound: float | None, slack: float = 0.0) -> bool:
    """Whether ``node`` is busier than ``(1 + bound)`` × the ``mean`` utilization plus
    ``slack`` (bounded load; None: never)."""
    if bound is None or mean <= 0.0:
        return False
    return node.utilization > (1.0 + bound) * mean + slack


def request_slack(node: NodeInfo, window_s: float) -> float:
    """One request's worth of ``node``'s busy time over the utilization's window: the slack
    a *forward* bound needs, since with light traffic (a single node active) the mean is
    tiny and a node must still be able to take the next request. Placement takes none: it
    only names who makes a copy not yet made, and at low load the slack is as large as the
    differences it must see (one request in a 10 s window against utilizations near 1/16)."""
    return node.speed.mean_service_s / window_s


class Router:
    """Ranks candidates under one policy; holds only the round-robin cursor."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._rr = 0

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
            return self._rank_cost(req, nodes, self._robust_speeds(avail), rng, placement)
        if policy is Policy.NONE:
            # No view is consulted, so no cache hit is claimed (the paper's no-route baseline).
            me = selves[0]
            latency = predict_latency(req, me, self.config.context_scale)
            return [Candidate(me.node_id, True, 0, latency)]
        if policy is Policy.PAPER:
            order = _by_match(avail)
        elif policy is Policy.RANDOM:
            order = avail[:]
            rng.shuffle(order)
        elif policy is Policy.ROUND_ROBIN:
            order = self._round_robin(avail)
        else:
            order = _least_loaded(avail, rng)
        return [self._candidate(req, n) for n in order]

    def _rank_cost(
        self,
        req: RouteInput,
        nodes: Sequence[NodeInfo],
        avail: list[NodeInfo],
        rng: Random,
        placement: Placement | None,
    ) -> list[Candidate]:
        """The cost policy: each candidate's mesh cost and whether it is preferred for the
        prefix are computed once, for the choice and for the ``beat_s`` each forward carries."""
        me = next(n for n in avail if n.is_self)
        costs = mesh_cost(req, avail, self.config.context_scale)
        cost_of = {n.node_id: c for n, c in zip(avail, costs, strict=True)}
        local = cost_of[me.node_id]
        preferred = set() if placement is None else {
            n.node_id for n in avail if self._preferred(req, n, me, placement)
        }
        order, bought = self._by_cost(req, avail, costs, rng, placement, preferred)
        if placement is None:
            return [self._candidate(req, n, None if n.is_self else local,
                                    cost_s=cost_of[n.node_id]) for n in order]
        owners = set(placement.owners)
        held = placement.held_tokens
        anyone = any(n.cached_tokens >= held for n in nodes)
        out = []
        for n in order:
            if n.is_self:
                beat = None
            elif n.node_id not in preferred:
                beat = local
            else:
                beat = self._preferred_limit(req, local, me, n.cached_tokens >= held)
            tag = Tag.LOCAL_COPY if n.is_self and bought else _tag(n, owners, held, anyone)
            out.append(self._candidate(req, n, beat, tag, cost_of[n.node_id]))
        return out

    def _robust_speeds(self, avail: list[NodeInfo]) -> list[NodeInfo]:
        """Speeds within ``speed_tolerance`` of the candidates' median are the median: only a
        difference larger than measurement noise (another GPU, a throttled node) counts."""
        tol = self.config.speed_tolerance
        if tol is None or len(avail) < 2:
            return avail
        median = median_speed([n.speed for n in avail])
        return [replace(n, speed=_snapped(n.speed, median, tol)) for n in avail]

    # ---------------------------------------------------------------------------- policies
    def _by_cost(
        self,
        req: RouteInput,
        avail: list[NodeInfo],
        costs: list[float],
        rng: Random,
        placement: Placement | None,
        preferred: set[str],
    ) -> tuple[list[NodeInfo], bool]:
        """The candidates, best first (``costs``: their mesh costs), and whether staying here
        is a bought copy (rent); ``preferred``: the owners and holders worth a round trip."""
        me = next(n for n in avail if n.is_self)
        keyed = [(c, n.queue_depth, rng.random(), n) for c, n in zip(costs, avail, strict=True)]
        keyed.sort(key=lambda k: (k[0], not k[3].is_self, k[1], k[2]))
        order = [k[3] for k in keyed]
        overloaded = self._over_bound(avail)
        mine = next(k for k in keyed if k[3].is_self)
        best = next((k for k in keyed if k[3].node_id not in overloaded), mine)
        if self._bypasses_bound(keyed[0], best):
            best = keyed[0]  # a large certain saving (a long cached prefix) beats balancing
        # Hysteresis against noisy *speed* estimates: a share of the local work, not of the
        # local queue wait (under load 10 % of the wait exceeded any cache saving); and
        # against stale *queue* views: what predictions of the peer's wait are lately off by.
        if mine[0] - best[0] < self._needed(mine[0] - predict_wait(me)) + best[3].wait_error_s:
            best = mine
        bought = False
        if placement is not None:
            held = placement.held_tokens
            best = self._placed(req, keyed, best, preferred, overloaded, rng, held)
            # Ski rental: a forward to a holder rents its copy for one round trip; a copy here
            # costs, once, what staying costs more than the forward now. Rent until the round
            # trips spent on this prefix reach that price, then buy. Over a 4 ms link against
            # a 0.3 s prefill that takes ~75 forwards of one prefix from this node (a hot one
            # is then copied here too); over a 400 ms one, where every node keeping its own
            # copy is what wins, the first or second request buys.
            # (A forward the placement slack chose, slower now than staying, is not a rental:
            # it avoids a second copy while gossip is a round behind.)
            # The price is never below the extra service the copy makes this node compute,
            # less the round trip it saves now: a holder that is busy for the moment makes
            # the forward slow, not the copy cheap (under load, copies bought while holders
            # were busy cost 6-9 points of hit rate and no latency in the simulator).
            gain = mine[0] - best[0]
            scale = self.config.context_scale
            extra_service = predict_service(req, me, scale) - predict_service(req, best[3], scale)
            price = max(gain, extra_service - best[3].rtt_s)
            renting = best[3].cached_tokens >= held > me.cached_tokens  # a hit there, not here
            if renting and gain > 0.0 and price <= placement.rent_s + best[3].rtt_s:
                best, bought = mine, True
        return [best[3], *(n for n in order if n is not best[3])], bought

    def _placed(
        self,
        req: RouteInput,
        keyed: list[tuple[float, float, float, NodeInfo]],
        best: tuple[float, float, float, NodeInfo],
        preferred: set[str],
        overloaded: set[str],
        rng: Random,
        held: int,
    ) -> tuple[float, float, float, NodeInfo]:
        """The best preferred candidate (an owner, or a node holding the prefix) if it costs
        at most ``placement_slack`` more than ``best`` now; near-equal ones are picked at
        random, self first (entry nodes sharing a stale view must not all pick one peer).
        The slack avoids a copy: where ``best`` holds the prefix (``held`` tokens) already,
        only a candidate holding more of the request than ``best``, by more than the
        hysteresis is worth, has one to avoid (a conversation whose newer turns a peer holds
        must not stay on the node that holds its first ones: the chat workload re-prefilled
        its history on the stale holder). Candidates over the load bound are not preferred."""
        cfg = self.config
        copies = best[3].cached_tokens < held  # serving at ``best`` copies the prefix
        pref = [
            k for k in keyed
            if k[3].node_id in preferred and k[3].node_id not in overloaded
            and (k is best or copies or self._holds_more(req, k[3], best[3]))
        ]
        if not pref:
            return best
        low = pref[0][0]  # keyed is sorted by prediction
        if low > self._preferred_limit(req, best[0], best[3], pref[0][3].cached_tokens >= held):
            return best  # every preferred node is busy or slow now: the fastest choice wins
        near = [k for k in pref if k[0] <= low + max(cfg.min_gain_s, cfg.near_tie * low)]
        if best in near:
            return best
        pick = next((k for k in near if k[3].is_self), None) or near[rng.randrange(len(near))]
        return self._holder_instead(pick, keyed, preferred, overloaded, held)

    def _preferred_limit(
        self, req: RouteInput, cost: float, alternative: NodeInfo, holder: bool
    ) -> float:
        """The most a preferred candidate may cost when ``alternative`` (the best choice now,
        predicted at ``cost``) is what it is preferred to: a holder, ``placement_slack`` more
        than all of ``cost``; an owner that would make the prefix's first copy (as would
        ``alternative``), that share of the copy's work only. Under load ``cost`` is mostly
        queue, and a slack on all of it let an owner's queue grow to 1.75x the others' for
        one copy (the real cluster with 16 clients: new subjects piled onto one owner,
        22-27 s each). Holders keep it: in the simulator (MMLU, 16 clients) the narrower
        slack for them too cost 1.8 points of hit rate and 4.5 % on the mean."""
        slack = self.config.placement_slack
        if holder:
            return cost * (1.0 + slack)
        return cost + slack * predict_service(req, alternative, self.config.context_scale)

    @staticmethod
    def _holder_instead(
        pick: tuple[float, float, float, NodeInfo],
        keyed: list[tuple[float, float, float, NodeInfo]],
        preferred: set[str],
        overloaded: set[str],
        held: int,
    ) -> tuple[float, float, float, NodeInfo]:
        """A peer the placement picked to make a copy gives way to a holder of the prefix
        predicted no slower now (the cheapest, within the load bound): the forward is made
        either way, and the holder needs no copy. (A holder that saves this node less than
        the hysteresis is not preferred for itself, so a chat conversation's second turn went
        to the owner of its key, which re-prefilled the first turn that the node it ran on
        held: 8 of 100 one-client requests, 811 tokens.) The holder carries the placement's
        ``beat_s`` (it joins ``preferred``)."""
        if pick[3].is_self or pick[3].cached_tokens >= held:
            return pick
        for k in keyed:  # sorted by prediction: the first one found is the cheapest
            if k[0] > pick[0]:
                break
            if k[3].cached_tokens >= held and k[3].node_id not in overloaded:
                preferred.add(k[3].node_id)
                return k
        return pick

    def _holds_more(self, req: RouteInput, node: NodeInfo, than: NodeInfo) -> bool:
        """Whether ``node`` holds more of the request than ``than`` by more than the
        hysteresis: what its longer cached prefix would save on ``than``'s speed."""
        if node.cached_tokens <= than.cached_tokens:
            return False
        scale = self.config.context_scale
        there = predict_service(req, than, scale)
        saved = there - predict_service(req, replace(than, cached_tokens=node.cached_tokens), scale)
        return saved >= self._needed(there)

    def _needed(self, work_s: float) -> float:
        """The least a forward must save over staying, for local work ``work_s``."""
        return max(self.config.min_gain_s, self.config.min_gain_frac * work_s)

    def _preferred(
        self, req: RouteInput, node: NodeInfo, me: NodeInfo, placement: Placement
    ) -> bool:
        """Whether ``node`` is preferred for the request's prefix: an owner or a holder, and,
        for a peer, one whose copy is worth a round trip. A copy there saves a later request
        entering elsewhere (here, say) the prefill of what it holds beyond this node's cache
        (a holder: its cached prefix; an owner: at most this whole prompt). Less the round
        trip and the queue error, that gain must be at least the hysteresis and at least one
        more round trip: else later requests would rent it briefly or not at all (ski
        rental), so concentrating the prefix there buys little.
        (At 1 s one way the slack sent cold 3,000-token prompts across a 2 s round trip; at
        200 ms it sent MMLU requests to holders of a 1,500-token prefix it took 0.3 s to
        prefill; with a long prompt every node holds, agentic steps to their scratchpad's
        holder for a few hundred tokens.)"""
        holds = node.cached_tokens >= placement.held_tokens
        if not holds and node.node_id not in placement.owners:
            return False
        if node.is_self:
            return True
        scale = self.config.context_scale
        copy = node.cached_tokens if holds else req.prompt_tokens
        here = predict_service(req, replace(node, cached_tokens=me.cached_tokens), scale)
        there = predict_service(req, replace(node, cached_tokens=copy), scale)
        net = here - there - node.rtt_s - node.wait_error_s  # what a later forward gains
        return net >= max(self._needed(here), node.rtt_s)

    def _bypasses_bound(
        self, top: tuple[float, float, float, NodeInfo], best: tuple[float, float, float, NodeInfo]
    ) -> bool:
        """Whether the fastest candidate, over the load bound, gets the request anyway: it has
        room (utilization under ``load_bound_floor``, or less than one request expected in
        its queue when this one arrives) and saves at least ``load_bound_bypass`` of the
        time. Utilization is a 10 s average: a holder that made a few long cold prefills
        lately is over the floor while idle now, and one client's requests never queue
        behind each other. On gpu-70b with one client (simulator panel, "g70 seq 2ms") the
        floor alone made 8 of 500 requests cold `replica` copies next to an idle holder
        (1.3 s instead of 0.2 s each); with the queue as well, 2 (mean 0.95x, p99 0.71x).
        The saving asked was half the time until an agent's step whose scratchpad its
        holder had (a few hundred tokens of 1,600) counted as small: with one client the
        bound kept steps off the holder of their previous one, each re-prefilling its
        scratchpad next to an idle holder (simulator, fitted speeds: 90.1 % of the prompt
        tokens cached against the gateway's 91.8 %; 91.1-91.8 % asking no saving)."""
        cfg = self.config
        room = top[3].utilization < cfg.load_bound_floor or top[3].queue_depth < 1.0
        return room and top[0] < (1.0 - cfg.load_bound_bypass) * best[0]

    def _over_bound(self, avail: list[NodeInfo]) -> set[str]:
        """Peers whose utilization exceeds ``(1 + load_bound)`` × the mean (bounded load)."""
        if len(avail) < 2:
            return set()
        mean = mean_utilization(avail)
        bound, window = self.config.load_bound, self.config.load_window_s
        return {
            n.node_id for n in avail
            if not n.is_self and over_bound(n, mean, bound, request_slack(n, window))
        }

    def _round_robin(self, avail: list[NodeInfo]) -> list[NodeInfo]:
        ordered = sorted(avail, key=lambda n: n.node_id)
        start = self._rr % len(ordered)
        self._rr += 1
        return ordered[start:] + ordered[:start]

    def _candidate(
        self,
        req: RouteInput,
        node: NodeInfo,
        beat_s: float | None = None,
        placement: Tag | None = None,
        cost_s: float | None = None,
    ) -> Candidate:
        expected = min(node.cached_tokens, req.prompt_tokens)
        return Candidate(
            node_id=node.node_id,
            is_self=node.is_self,
            expected_cached_tokens=expected,
            predicted_latency_s=predict_latency(req, node, self.config.context_scale),
            beat_s=beat_s,
            placement=placement,
            wait_s=predict_wait(node),
            cost_s=cost_s,
        )


def _tag(node: NodeInfo, owners: set[str], held: int, anyone: bool) -> Tag:
    if node.cached_tokens >= held:
        return Tag.HIT
    if node.node_id in owners:
        return Tag.REPLICA if anyone else Tag.FIRST
    return Tag.SECOND_COPY if anyone else Tag.UNPLACED


def _snapped(speed: SpeedReport, median: SpeedReport, tol: float) -> SpeedReport:
    """``speed`` with its prefill line replaced by the median's if its times at both reference
    sizes are within ``tol`` of the median's, and likewise its decode rate. The hardware's
    speed only: not ``mean_service_s``, which follows the node's own mix of cached and cold
    requests (it prices that node's queue) and really differs between nodes. The prefill is
    compared as a whole: overhead and rate are fitted together, and nodes that agree on the
    prefills they served may split them differently."""
    mine, mid = prefill_times(speed), prefill_times(median)
    if all(m / tol <= t <= m * tol for t, m in zip(mine, mid, strict=True)):
        speed = replace(speed, prefill_overhead_s=median.prefill_overhead_s,
                        prefill_s_per_token=median.prefill_s_per_token)
    decode, mid_decode = speed.decode_s_per_token, median.decode_s_per_token
    if mid_decode / tol <= decode <= mid_decode * tol:
        speed = replace(speed, decode_s_per_token=mid_decode)
    return speed


def _by_match(avail: list[NodeInfo]) -> list[NodeInfo]:
    return sorted(avail, key=lambda n: (-n.cached_tokens, not n.is_self, n.node_id))


def _least_loaded(avail: list[NodeInfo], rng: Random) -> list[NodeInfo]:
    keyed = [(n.queue_depth, not n.is_self, rng.random(), n) for n in avail]
    keyed.sort(key=lambda k: k[:3])
    return [k[3] for k in keyed]
