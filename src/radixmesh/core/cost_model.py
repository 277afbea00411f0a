"""The cost model: what the deciding node believes of each node, and what a request costs there.

Theory of operation
-------------------
One :class:`NodeInfo` per node (self included) says what the deciding node *believes*: how
many of the request's tokens it has cached, whether it is available, its forward round trip,
its queue (exact for self, expected for a peer), speed and utilization. From those:

* :func:`predict_service` — engine time (the uncached part prefilled, then decode);
* :func:`predict_wait` — queue wait (each place priced by the queued tokens for self, else
  at the mean service time; a peer's corrected by how late its forwards lately answered);
* :func:`predict_latency` — round trip (peers) + wait + service: what the request sees;
* :func:`mesh_cost` — that, plus what the choice costs the requests queued behind it and
  those arriving while it runs: what the cost policy ranks by;
* :func:`predict_ttft` — round trip + wait + the prefill until the first token;
* :func:`robust_speeds` — speeds near the candidates' median count as the median;
* :func:`candidate` — a ranked :class:`Candidate` for one node, tagged (:class:`Tag`) with
  what serving there does to the prefix's copies.

A node that reports a batching engine's batch (``NodeInfo.batch``: its shadow of the engine,
``core/shadow.py``, exact for self, a peer's gossiped report aged) is priced by what its
engine will do, not as a FIFO queue of whole services: the wait is the prompt work ahead
and the step under way, the service its own prefill in that batch then its decode steps
(``shadow_state.ttft_parts``), its cost to others what its prefill delays the requests
arriving meanwhile and the decodes sharing its steps (:func:`batch_externality`), and the
load bound does not apply to it (its predicted TTFT already holds its load). The FIFO model
priced an H100 running a few requests as seconds busy and gave away hits: 16 emulated
H100s, RAG at 80 %, `cost` cached 76 % against the gateways' 87 %.

All pure functions of their arguments; the policies (``core/router.py``,
``core/cost_policy.py``) rank with them, admission (``core/admission.py``) checks a peer's
forward with :func:`mesh_cost` too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from operator import attrgetter

from radixmesh.core.estimators import SpeedReport, median_speed, prefill_times
from radixmesh.core.shadow_state import BatchState, decode_s, ttft_parts


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
    # (``load_estimates.WaitError``: a peer's view is stale under bursty load); 0 for self
    wait_error_s: float = 0.0
    # what one place in its queue costs, from its queued requests' tokens (self only: its
    # exact queue; ``SpeedReport.queued_service_s``); None: the speed's mean service time
    queue_service_s: float | None = None
    kv_usage: float = 0.0  # its KV cache's fill in [0, 1] as last reported (cache / budget)
    # a batching engine's batch (exact for self, from its shadow; a peer's report aged):
    # its wait and service are then its predicted TTFT's parts (``core/shadow_state.py``)
    batch: BatchState | None = None
    # how much later than predicted it lately met our forwards (a peer's, learnt from them:
    # ``load_estimates.Lateness``; signed); 0 for self. Added to the wait
    lateness_s: float = 0.0
    lateness_median_s: float = 0.0  # the same residuals' median: the TTFT forecast's correction

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
    # the prefix's request rate at this node (``KeyRates.confident_rate``, requests/s): the
    # rentals still to come if no copy is made here (ski rental with a known rate)
    rate_hz: float = 0.0


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
    # its TTFT forecast (round trip included; a peer's wait corrected by the median of its
    # lateness, not the mean that ranks: ``load_estimates.Lateness``)
    ttft_s: float | None = None
    # the TTFT the ranking priced (the wait with the lateness's mean): what a forward's first
    # token is checked against (``PeerLoads.late_by``)
    ranked_ttft_s: float | None = None


def predict_service(req: RouteInput, node: NodeInfo, context_scale: float) -> float:
    """The engine time the request would take on ``node`` (its uncached part prefilled);
    on a batching engine, its own prefill in the current batch, then its decode steps."""
    if node.batch is not None:
        prefill = predict_prefill(req, node, context_scale)
        return prefill + decode_s(node.batch, req.max_tokens, req.prompt_tokens)
    uncached, cached = _split(req, node)
    return node.speed.service_s(uncached, cached, req.max_tokens, context_scale)


def _split(req: RouteInput, node: NodeInfo) -> tuple[int, int]:
    """(uncached, cached) prompt tokens of ``req`` on ``node``: at least the last token is
    computed (there must be logits)."""
    cached = min(node.cached_tokens, max(0, req.prompt_tokens - 1))
    return req.prompt_tokens - cached, cached


def predict_prefill(req: RouteInput, node: NodeInfo, context_scale: float) -> float:
    """The part of the service before the first token: on a batching engine its own
    prefill in the current batch (``shadow_state.ttft_parts``), else the prefill line's."""
    uncached, cached = _split(req, node)
    if node.batch is not None:
        return ttft_parts(node.batch, uncached, cached)[1]
    return node.speed.prefill_s(uncached, cached, context_scale)


def predict_wait(node: NodeInfo) -> float:
    """The queue wait a request meets on ``node``: its queue, each place priced by what the
    queued requests will compute (else at the node's mean service time); on a batching
    engine, the prompt work ahead of it and the step under way (``ttft_parts``); plus, for a
    peer, how late it lately met our forwards (``lateness_s``; the wait never below 0)."""
    return max(0.0, _raw_wait(node) + node.lateness_s)


def _raw_wait(node: NodeInfo) -> float:
    """:func:`predict_wait` before the peer's lateness."""
    if node.batch is not None:
        return ttft_parts(node.batch, 1, 0)[0]
    per = node.speed.mean_service_s if node.queue_service_s is None else node.queue_service_s
    return node.queue_depth * per


def predict_ttft(req: RouteInput, node: NodeInfo, context_scale: float) -> float:
    """Round trip (peers only) + queue wait + the prefill until the first token."""
    rtt = 0.0 if node.is_self else node.rtt_s
    return rtt + predict_wait(node) + predict_prefill(req, node, context_scale)


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
    load the wait differences a node sees are a gossip round old, while a miss's work is paid
    by everyone after it: the selfish latency alone gave hits away as soon as queues formed.
    Priced by this node's queue alone (an earlier design), a node lacking the agentic system
    prompt kept forwarding to busy holders while its engine idled (1.11x `none`, real, 80 %).

    That term stands for the requests arriving while this one waits, each waiting all of its
    service; those arriving while it is served wait half of it, and a node's queue now does
    not show them: a node serving ``utilization / mean_service_s`` requests per second (its
    gossiped utilization: everyone's traffic there) sees that rate x the service arrive
    meanwhile, so the service counts once more x that rate x half of it: quadratic in it. A
    hit of a few ms at a hot prefix's busy holder costs its stream next to nothing; a long
    prompt there holds up all of it (on the real cluster at 80 % load a 3,014-token request
    sent to the hot prefix's holder queued those behind it 4-5 s). With it the simulator's
    workload matrix cached 0.1-2.1 points more of the prompt tokens under load, and on one
    shared core `cost`/`none` went 0.730 -> 0.714 (geometric mean)."""
    decoding = mesh_decoding(nodes)
    return [priced(req, n, context_scale, decoding).cost_s for n in nodes]


@dataclass(frozen=True, slots=True)
class Priced:
    """One node's predictions for a request, each computed once (the router's hot path):
    what :func:`candidate` reports and :func:`mesh_cost` ranks by."""

    ahead_s: float  # round trip (peers) + queue wait
    prefill_s: float  # its prefill until the first token
    service_s: float  # prefill, then decode
    cost_s: float  # the mesh cost (``mesh_cost``)
    ttft_s: float  # the TTFT forecast: ``ahead_s`` with the median lateness, + ``prefill_s``


def priced(req: RouteInput, n: NodeInfo, context_scale: float,
           decoding: float | None = None) -> Priced:
    """``n``'s :class:`Priced` for ``req``: the sums of ``predict_latency`` / ``predict_ttft``
    / ``mesh_cost``, each term evaluated once (``decoding``: see :func:`batch_externality`)."""
    rtt, raw = (0.0 if n.is_self else n.rtt_s), _raw_wait(n)
    ahead = rtt + max(0.0, raw + n.lateness_s)
    prefill = predict_prefill(req, n, context_scale)
    ttft = rtt + max(0.0, raw + n.lateness_median_s) + prefill
    if n.batch is not None:
        service = prefill + decode_s(n.batch, req.max_tokens, req.prompt_tokens)
        cost = ahead + service + batch_externality(req, n, context_scale, decoding)
        return Priced(ahead, prefill, service, cost, ttft)
    # predict_service's sum, its prefill computed once
    service = prefill + n.speed.decode_s_per_token * max(0, req.max_tokens - 1)
    mean = n.speed.mean_service_s
    arrivals = n.utilization / mean if mean > 0.0 else 0.0  # requests/s it serves
    cost = ahead + service + service * n.queue_depth + arrivals * service * service / 2.0
    return Priced(ahead, prefill, service, cost, ttft)


def batch_externality(req: RouteInput, node: NodeInfo, context_scale: float,
                      decoding: float | None = None) -> float:
    """What the request's prefill on a batching engine costs the others there: the requests
    arriving while it waits and computes (``BatchState.rate`` per second) queue behind its
    prompt compute (``BatchState.marginal_prefill_s``; those arriving during it, half), and
    each sequence decoding in its steps (:func:`decoders`) waits that compute for its next
    token. Without the decodes, 16 simulated H100s, chat at 80 %: `cost` cached 51 % against
    the gateway's 64 % (0.55 s mean against 0.37), with them 61 % (0.46 s). Charged the
    request's whole prefill in the batch instead, the steps' fixed part too (which they pay
    anyway), the arrivals' term (~1 s at 1.6x the planned capacity of 16 H100s) outweighed
    the rest and sent 43 % of agentic steps away from their scratchpad's holder for a wait
    0.1 s shorter elsewhere (goodput 51 %, the gateway's 83 %; at the compute, 15 %, 71 %)."""
    assert node.batch is not None
    b = node.batch
    own = predict_prefill(req, node, context_scale)
    uncached, cached = _split(req, node)
    arrivals = b.rate * (predict_wait(node) + own / 2.0)
    decodes = decoders(b.decoding, decoding) * b.prefill_compute_s(uncached, cached)
    return arrivals * b.marginal_prefill_s(uncached, cached) + decodes


def decoders(own: int, decoding: float | None) -> float:
    """The decode batch a candidate's prompt compute is priced against: the decision's
    (:func:`mesh_decoding`), unless the candidate's ``own`` is below it by more than a count's
    noise (3 x its square root + 3), then its own (None: its own). At each node's own batch
    prompts went to whichever node decoded fewer at that moment (an aged report; the wait
    prices load already; 16 H100s at 80 %: agentic 45.4 ms mean TTFT, at one batch 36.7),
    but at the decision's a slow engine left idle was charged for decodes it does not have:
    4 H100s + 12 A10Gs, agentic at 3x, 97 % of requests stayed on the H100s (goodput 25 %;
    at their own, 99.5 %)."""
    if decoding is None or decoding - own > 3.0 * (decoding**0.5 + 1.0):
        return float(own)
    return decoding


def mesh_decoding(nodes: Sequence[NodeInfo]) -> float | None:
    """The decode batch one decision prices every candidate's prompt compute against
    (:func:`batch_externality`): the mean over the candidates with a batching engine (None:
    none has one). A node checking a forward alone prices it against its own batch."""
    total, count = 0, 0
    for n in nodes:
        if n.batch is not None:
            total += n.batch.decoding
            count += 1
    return total / count if count else None


def robust_speeds(avail: list[NodeInfo], tol: float | None) -> list[NodeInfo]:
    """Speeds within ``tol`` (``speed_tolerance``) of the candidates' median are the median:
    only a difference larger than measurement noise (another GPU, a throttled node) counts.
    (A node whose speed comes out unchanged is passed on as it is: the hot path.)"""
    if tol is None or len(avail) < 2:
        return avail
    median = median_speed([n.speed for n in avail])
    snapped: dict[int, SpeedReport] = {}  # by id: peers often share one report object
    out = []
    for n in avail:
        speed = snapped.get(id(n.speed))
        if speed is None:
            speed = snapped[id(n.speed)] = _snapped(n.speed, median, tol)
        out.append(n if speed is n.speed else _with(n, _SPEED, speed))
    return out


def _snapped(speed: SpeedReport, median: SpeedReport, tol: float) -> SpeedReport:
    """``speed`` with its prefill line replaced by the median's if its times at both reference
    sizes are within ``tol`` of the median's, and likewise its decode rate. The hardware's
    speed only: not ``mean_service_s``, which follows the node's own mix of cached and cold
    requests (it prices that node's queue) and really differs between nodes. The prefill is
    compared as a whole: overhead and rate are fitted together, and nodes that agree on the
    prefills they served may split them differently. (``speed`` itself when nothing changes.)"""
    overhead, rate = speed.prefill_overhead_s, speed.prefill_s_per_token
    if overhead != median.prefill_overhead_s or rate != median.prefill_s_per_token:
        mine, mid = prefill_times(speed), prefill_times(median)
        if all(m / tol <= t <= m * tol for t, m in zip(mine, mid, strict=True)):
            overhead, rate = median.prefill_overhead_s, median.prefill_s_per_token
    decode, mid_decode = speed.decode_s_per_token, median.decode_s_per_token
    if decode != mid_decode and mid_decode / tol <= decode <= mid_decode * tol:
        decode = mid_decode
    if (overhead, rate, decode) == (
        speed.prefill_overhead_s, speed.prefill_s_per_token, speed.decode_s_per_token
    ):
        return speed
    return SpeedReport(prefill_overhead_s=overhead, prefill_s_per_token=rate,
                       decode_s_per_token=decode, mean_service_s=speed.mean_service_s)


# NodeInfo with one field replaced, without ``dataclasses.replace``'s per-call field walk
# (the router copies a few per decision: 3.5 -> 1.7 us each)
_NODE_FIELDS = tuple(f.name for f in fields(NodeInfo))
_node_values = attrgetter(*_NODE_FIELDS)
_SPEED, _CACHED = _NODE_FIELDS.index("speed"), _NODE_FIELDS.index("cached_tokens")


def _with(node: NodeInfo, index: int, value: object) -> NodeInfo:
    values = list(_node_values(node))
    values[index] = value
    return NodeInfo(*values)


def with_cached(node: NodeInfo, cached_tokens: int) -> NodeInfo:
    """``node`` as if it held ``cached_tokens`` of the request (``replace``, faster)."""
    return _with(node, _CACHED, cached_tokens)


def candidate(
    req: RouteInput,
    node: NodeInfo,
    context_scale: float,
    beat_s: float | None = None,
    placement: Tag | None = None,
    cost_s: float | None = None,
    parts: Priced | None = None,
) -> Candidate:
    """``node`` as a ranked candidate for the request (its predictions filled in; ``parts``:
    its :class:`Priced`, if the caller has it)."""
    p = priced(req, node, context_scale) if parts is None else parts
    return Candidate(
        node_id=node.node_id,
        is_self=node.is_self,
        expected_cached_tokens=min(node.cached_tokens, req.prompt_tokens),
        predicted_latency_s=p.ahead_s + p.service_s,
        beat_s=beat_s,
        placement=placement,
        wait_s=p.ahead_s - (0.0 if node.is_self else node.rtt_s),
        cost_s=cost_s,
        ttft_s=p.ttft_s,
        ranked_ttft_s=p.ahead_s + p.prefill_s,
    )
