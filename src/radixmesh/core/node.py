"""NodeCore: one node's whole decision logic as a pure state machine (events in, actions out).

Theory of operation
-------------------
::

      shell (asyncio runtime | simulator)                NodeCore (pure)
      ─────────────────────────────────────            ──────────────────────────────────────
      timer fires at next_deadline()  ── Tick ──────▶  expire silent peers, gossip round
      peer bytes arrive               ── MessageReceived ▶ decode (reject+count if bad), apply
      engine cache changed            ── CacheChanged ─▶ local summary (version += 1)
      engine queue gained/lost a request ─ QueueChanged ▶ local summary: queued blocks held
      engine load changed             ── LoadChanged ──▶ own load; push-back if queue > limit
                                                         and > relative × the peers' mean
      request finished                ── RequestServed ▶ own ComputeModel (speed)
      client request arrives          ── RequestArrived ▶ route → Forward | ExecuteLocally
      forward accepted/refused/failed ── Forward* ─────▶ next try | continue locally
      request done / client gone      ── RequestDone / RequestCancelled ▶ RTT, view | Abort
      a peer forwards to us           ── ForwardArrived ▶ AcceptForward | RefuseForward
      SIGTERM                         ── LeaveRequested ▶ no new work, gossip round at once
      a DNS name resolved again       ── SeedsDiscovered ▶ greet new seed addresses
                                      ◀── Send / Log / PeerStateChanged / request actions

A request's whole life at its entry node (which peer next, when to stop trying peers, route
labels, continuing locally after a peer died mid-stream) is decided by
:class:`~radixmesh.core.lifecycle.Lifecycle`; this class adds what the rest of the node
learns from it (suspect a failed peer, skip a busy one, RTT samples, optimistic view inserts).

Leaving (``LeaveRequested(grace_s)``): the node counts as full for its own client requests
(the lifecycle then tries the peers further down the ranking and rejects with a retry-after
when none takes it: the same path as bounded admission), refuses every forward as busy
(``forwards_refused_leaving``, retry after the rest of the grace), and runs a gossip round at
once whose load advertises push-back for the whole grace period — at least
``PushbackConfig.duration_s`` for as long as it is leaving. Why push-back and not a new wire
field: every peer already honours push-back (it stops routing to the node the moment the
message arrives, epidemic relays carry it on), so old and new nodes interoperate with the
wire format unchanged; when the node is gone, the silence timeouts take over (they are
shorter than any sensible grace, so the node is suspect before the push-back runs out).
Seeds (``SeedsDiscovered``): new addresses are greeted at once and then retried with the
failure detector's backoff.

Only the shell owns a clock; ``now`` is seconds on the shell's clock and is never compared
across nodes (push-back durations and RTT echoes are relative). Randomness comes from the
``random.Random`` given at construction (gossip jitter, target sampling, router tie-breaks).

Why one file over 400 lines: ``NodeCore`` is the one object the shells talk to; its
handlers are thin (each delegates to the gossip parts, the lifecycle or the router), and
splitting the facade would only scatter its event table and its inspection methods.

Routing cost is O(request blocks + k): the peer view's inverted index yields the ``k`` deepest
matching available peers (``PeerView.match_top``), never every matched peer. Policies that
consider every node (random, round_robin, least_loaded) use the gossiper's incrementally
maintained routable set; ``cost`` also considers the two least-loaded unmatched peers, found
through a lazily cleaned heap.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from random import Random  # the type only: instances are passed in, never the global one
from typing import Any

from radixmesh.core.codec import Codec, Limits, RemoteProtocolError
from radixmesh.core.config import AdmissionConfig, GossipMode, NodeConfig
from radixmesh.core.decisions import DecisionLog
from radixmesh.core.estimators import (
    ComputeModel,
    CostPriors,
    Ewma,
    RttTable,
    SpeedReport,
    Utilization,
    WaitError,
    speed_is_stale,
)
from radixmesh.core.events import (
    AcceptForward,
    Action,
    CacheChanged,
    Event,
    ForwardAccepted,
    ForwardArrived,
    ForwardFailed,
    ForwardRefused,
    LeaveRequested,
    LoadChanged,
    Log,
    MessageReceived,
    QueueChanged,
    RefuseForward,
    RequestArrived,
    RequestCancelled,
    RequestDone,
    RequestServed,
    SeedsDiscovered,
    Tick,
)
from radixmesh.core.gossip import Estimate, Gossiper
from radixmesh.core.lifecycle import Lifecycle, Stage
from radixmesh.core.membership import Membership, MemberState
from radixmesh.core.messages import Load
from radixmesh.core.peerview import PeerView
from radixmesh.core.placement import KeyRates, KeySums, Ring, placement_depth, replicas_for
from radixmesh.core.router import (
    Candidate,
    NodeInfo,
    Placement,
    Policy,
    RouteInput,
    Router,
    Tag,
    mean_utilization,
    mesh_cost,
    over_bound,
    predict_wait,
)
from radixmesh.core.summary import Holdings, LocalSummary

IDLE_PEERS = 2  # unmatched least-loaded peers the cost policy also considers
ROUTE_TOP_K = 8  # deepest-matching available peers considered per request
SHARED_CHECK_MAX = 32  # members: up to this many, a request's prefix common to all is found
# a peer reporting a longer queue wait (a forward's, or its refusal's) is not believed
MAX_REPORTED_WAIT_S = 3600.0


class _Unavailable:
    """``peer in _Unavailable(node, now)``: whether routing must skip that peer (lazy)."""

    __slots__ = ("_node", "_now")

    def __init__(self, node: NodeCore, now: float) -> None:
        self._node = node
        self._now = now

    def __contains__(self, peer: object) -> bool:
        return not (isinstance(peer, str) and self._node.available(peer, self._now))


# a stale own speed restarts from the median of at most this many fresh peers' speeds
SPEED_SAMPLE = 16

_COUNTERS = (
    "gossip_bytes_in",
    "gossip_bytes_out",
    "gossip_messages_in",
    "gossip_messages_out",
    "gossip_rounds",
    "gossip_rounds_announced",  # rounds brought forward by a change to our cache
    "messages_rejected",
    "messages_rejected_decode",
    "messages_rejected_size",
    "messages_rejected_version",
    "messages_rejected_fingerprint",
    "messages_rejected_stale",
    "messages_rejected_self",
    "gossip_snapshots_applied",
    "gossip_deltas_applied",
    "gossip_stale_summaries",
    "gossip_gaps",
    "gossip_snapshot_fallbacks",
    "peer_restarts",
    "rtt_samples",
    "forward_waits_rejected",  # a peer reported a queue wait out of range (ignored)
    "forwards_succeeded",
    "forwards_failed",
    "forwards_refused",  # our forwards a peer answered "busy"
    "forwards_refused_busy",  # peers' forwards we refused: queue at the push-back threshold
    "forwards_refused_slower",  # ... and because we would not beat their local prediction
    "forwards_refused_full",  # ... and because our queue is full (bounded admission)
    "forwards_refused_leaving",  # ... and because this node is leaving (drain)
    "seeds_discovered",  # new seed addresses learnt after start (DNS)
    "requests_served",
    "speed_adopted",  # an own speed estimate gone stale restarted from the peers' median
    "routes",
    "pushback_started",
)


@dataclass(frozen=True, slots=True)
class QueueSeen:
    """A peer's latest queue report as this node took it in."""

    stamp: float | None  # the load report's stamp (None: no stamp)
    sent: int  # our forwards sent so far when it arrived (``Lifecycle.forwards_sent``)
    at: float  # our clock then
    depth: float  # its queue depth, or the depth its latest refusal's queue wait implies


class NodeCore:
    """Local summary + peer view + membership + gossip + router of one node."""

    def __init__(self, config: NodeConfig, rng: Random, now: float) -> None:
        self.config = config
        self._rng = rng
        self._metrics: dict[str, float] = dict.fromkeys(_COUNTERS, 0.0)
        self._summary = LocalSummary(config.gossip.change_log_limit)
        self._holdings = Holdings(self._summary)  # the summary: cached + queued blocks
        self._view = PeerView()
        seeds = tuple(s for s in config.seeds if s != config.address)
        self._members = Membership(config.node_id, seeds)
        self._compute = ComputeModel(config.priors)
        self._token_rate = TokenRate(config.priors)  # bounded admission's default token cap
        self._rtt = RttTable(config.priors)
        self._busy = Utilization(config.router.load_window_s)
        # when the own speed estimate was last refreshed (served, adopted); None: it is
        # still the configured prior
        self._speed_at: float | None = None
        # when it last measured its speed itself (served a request): what its load reports
        # tell peers (``Load.speed_measured_at``), not the time of an adoption
        self._measured_at: float | None = None
        # per peer: how far the queue waits our forwards met were from what we predicted
        self._wait_errors: dict[str, WaitError] = {}
        self._router = Router(config.router)
        self.decisions = DecisionLog(config.decision_log)  # its recent routing decisions
        self._codec = Codec(
            Limits(
                max_message_bytes=config.gossip.max_message_bytes,
                max_hashes=config.gossip.max_hashes,
            )
        )
        self._gossip = Gossiper(
            config, self._summary, self._view, self._members, self._rtt, self._codec, rng,
            self._metrics,
        )
        self._load = LoadChanged(0, 0, 0, 0)
        self._prior_speed = self._compute.report()
        self._load_cache: Load | None = None  # for peers whose speed is not known yet
        self._pushback_until: float | None = None
        self._leaving_until: float | None = None  # LeaveRequested: end of the grace period
        self._next_round = now  # the first Tick joins the seeds at once
        self._last_round = now
        self._idle: list[tuple[int, float, str]] = []  # (queue depth, stamp, peer) lazy heap
        self._ring = Ring()  # prefixes' owners (consistent hashing over routable members)
        self._ring_checked = now  # when the ring's members are checked again at the latest
        self._key_rates = KeyRates(config.router.replica_window_s)  # requests/s per prefix here
        self._key_rent = KeySums(config.router.rent_window_s)  # rent paid per prefix
        # peer -> its latest load report (``QueueSeen``); and the sum of those reports' queue
        # depths (the mesh's mean)
        self._load_seen: dict[str, QueueSeen] = {}
        self._queue_sum = 0.0
        self._lifecycle = Lifecycle(
            config.forward,
            lambda peer: self.peer_address(peer),
            config.admission.min_retry_after_s,
        )
        self._handlers = self._handler_table()

    def _handler_table(self) -> dict[type, Callable[[Any, float], list[Action]]]:
        """Event type -> the method that applies it."""
        return {
            Tick: self._tick,
            MessageReceived: self._receive,
            CacheChanged: self._cache_changed,
            QueueChanged: self._queue_changed,
            LoadChanged: self._load_changed,
            RequestServed: self._served,
            RequestArrived: self._arrived,
            ForwardAccepted: self._accepted,
            ForwardRefused: self._refused,
            ForwardFailed: self._failed,
            RequestDone: self._done,
            RequestCancelled: self._cancelled,
            ForwardArrived: self._forward_arrived,
            LeaveRequested: self._leave,
            SeedsDiscovered: self._seeds_discovered,
        }

    # ------------------------------------------------------------------------- identity
    @property
    def node_id(self) -> str:
        return self.config.node_id

    @property
    def incarnation(self) -> int:
        return self.config.incarnation

    @property
    def leaving(self) -> bool:
        """Whether ``LeaveRequested`` arrived: no new work is taken (see the module doc)."""
        return self._leaving_until is not None

    # --------------------------------------------------------------------------- events
    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply one event; returns the actions the shell must carry out."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"unknown event {event!r}")  # a bug in the shell, not a peer
        return handler(event, now)

    def next_deadline(self) -> float:
        """When the next Tick is due (the shell's clock)."""
        return self._next_round

    def _tick(self, _: Tick, now: float) -> list[Action]:
        if now < self._next_round:
            return []
        actions = self._gossip.expire(now)
        actions.extend(self._round(now))
        return actions

    def _round(self, now: float) -> list[Action]:
        cfg = self.config.gossip
        self._last_round = now
        self._next_round = now + cfg.interval_s * (1.0 + cfg.jitter_frac * self._rng.random())
        self._count("gossip_rounds")
        self._refresh_stale_speed(now)
        sends = self._gossip.round(now, self._own_load(now))
        return self._account_out(sends)

    def _receive(self, event: MessageReceived, now: float) -> list[Action]:
        data, msg = event.data, event.message
        self._count("gossip_messages_in")
        self._count("gossip_bytes_in", len(data))
        if msg is None:  # from a network: decode and validate (the in-process one is trusted)
            try:
                msg = self._codec.decode(data)
            except RemoteProtocolError as exc:
                self._count("messages_rejected")
                self._count(f"messages_rejected_{exc.reason}")
                return [Log("debug", f"rejected a peer message: {exc}")]
        actions = self._gossip.receive(msg, now, self._own_load(now))
        self._note_load(msg.sender, now)
        for relayed in msg.relays:
            self._note_load(relayed.node_id, now)
        return self._account_out(actions)

    def _note_load(self, peer: str, now: float) -> None:
        est = self._gossip.estimates.get(peer)
        if est is not None and est.load is not None:
            seen = self._load_seen.get(peer)
            if seen is None or seen.stamp != est.stamp:  # a new load report: its queue is fresh
                self._queue_seen(peer, est.stamp, est.load.queue_depth, now)
        if est is not None and est.load is not None and peer in self._gossip.routable:
            heapq.heappush(self._idle, (est.load.queue_depth, est.stamp or 0.0, peer))
            self._trim_idle()

    def _queue_reported(self, peer: str, queue_s: float, now: float) -> None:
        """``peer`` refused our forward as slower and said its queue wait: a report of its
        queue fresher than its last gossip (its places priced at its mean service), which the
        next decisions age like any report (``_expected_queue``). The peer stays a candidate:
        a holder that refused one request (a cold one, say) still gets the hits it holds
        when they pay with the queue it really has. (Backing off from it for that wait, as
        from a pushed-back peer, made the holder unavailable to this node and its prefixes
        look held by nobody: on 4 simulated nodes with 16 clients, `first` copies of
        subjects queued at their owner were made on the next member of the ring.)"""
        if not 0.0 <= queue_s <= MAX_REPORTED_WAIT_S:  # a peer's claim: bounded
            self._count("forward_waits_rejected")
            return
        est = self._gossip.estimates.get(peer)
        seen = self._load_seen.get(peer)
        if est is None or est.load is None or seen is None:
            return
        speed = est.speed or self._prior_speed
        self._queue_seen(peer, seen.stamp, queue_s / max(speed.mean_service_s, 1e-6), now)

    def _queue_seen(self, peer: str, stamp: float | None, depth: float, now: float) -> None:
        """Record ``peer``'s queue ``depth`` as seen now (its load report's ``stamp``), and
        keep the sum of the latest depths (the mesh's mean queue) in step."""
        seen = self._load_seen.get(peer)
        self._queue_sum += depth - (0.0 if seen is None else seen.depth)
        self._load_seen[peer] = QueueSeen(stamp, self._lifecycle.forwards_sent, now, depth)

    def _cache_changed(self, event: CacheChanged, now: float) -> list[Action]:
        if self._holdings.cache_changed(event.added, event.removed):
            self._announce(now)
        return []

    def _queue_changed(self, event: QueueChanged, _: float) -> list[Action]:
        self._holdings.queue_changed(event.hashes, event.joined)  # (with the next round)
        return []

    def _announce(self, now: float) -> None:
        """Bring the next round forward (to ``announce_gap_s`` after the last one) so peers
        hear of a change to our cache before the next request that needs it. A chat turn or
        an agent's step follows its predecessor's answer within milliseconds, at whichever
        node; a view a whole round old sent it where its history was not
        (docs/benchmarks-history.md, "The round of `aed2d82`": chat with 16 simulated
        clients cached 68 % of its prompt tokens, 75 % with announcements).
        Delta mode only: a round there carries the few changed hashes to every member; a
        snapshot round carries the whole set, and an epidemic one reaches ``fanout`` members."""
        cfg = self.config.gossip
        if cfg.announce_gap_s is None or cfg.mode is not GossipMode.DELTA:
            return
        due = max(now, self._last_round + cfg.announce_gap_s)
        if due < self._next_round:
            self._next_round = due
            self._count("gossip_rounds_announced")

    def _load_changed(self, event: LoadChanged, now: float) -> list[Action]:
        self._load = event
        self._busy.set_busy(event.queue_depth > 0, now)
        self._load_cache = None
        pb = self.config.pushback
        if not self._pushes_back_at(event.queue_depth):
            return []
        active = self._pushback_until is not None and self._pushback_until > now
        self._pushback_until = now + pb.duration_s
        if active:
            return []
        self._count("pushback_started")
        self._next_round = now  # advertise at once: the shell ticks us immediately
        return [Log("info", f"queue depth {event.queue_depth} > {pb.queue_threshold}: push-back")]

    def _pushes_back_at(self, depth: int) -> bool:
        """Whether a queue ``depth`` deep is one this node pushes back at: over the threshold
        and, with ``relative``, over that many times the mean queue its peers last reported
        (their gossip, or the waits they gave when refusing us). When every node is as busy,
        backing off from one only moves its work to nodes as busy and makes the prefixes it
        holds look held by nobody: in the simulator, Poisson arrivals at 45 % of the capacity
        of a mesh that caches 85 % (4 nodes) turned into a collapse, every queue over the
        threshold, every node pushed back, every request computed where it entered (`cost`
        1.0x `none`, 3.4 s a request, against the gateway model's 0.35 s); at 16 nodes from
        80 %."""
        pb = self.config.pushback
        if depth <= pb.queue_threshold:
            return False
        if pb.relative is None or not self._load_seen:
            return True
        return depth > pb.relative * self._peers_mean_queue()

    def _peers_mean_queue(self) -> float:
        """The mean of the queue depths the peers last reported (0: no report yet)."""
        return self._queue_sum / max(len(self._load_seen), 1)

    def _leave(self, event: LeaveRequested, now: float) -> list[Action]:
        """Stop taking new work and tell every peer now (push-back for the grace period)."""
        if self._leaving_until is not None:
            return []
        self._leaving_until = now + max(event.grace_s, 0.0)
        self._load_cache = None
        actions: list[Action] = [Log("info", f"leaving: draining for {event.grace_s:g} s")]
        actions.extend(self._round(now))  # the push-back goes out in this very round
        return actions

    def _seeds_discovered(self, event: SeedsDiscovered, now: float) -> list[Action]:
        """Greet new seed addresses at once (then the failure detector's backoff applies)."""
        added = self._gossip.failure.add_seeds(event.addresses)
        if not added:
            return []
        self._count("seeds_discovered", len(added))
        load = self._own_load(now)
        hello = self._gossip.dissemination.hello
        actions: list[Action] = [hello(a, now, load, reply=True) for a in added]
        self._account_out(actions)
        actions.append(Log("info", f"new seeds: {', '.join(added)}"))
        return actions

    # ---------------------------------------------------------------- request lifecycle
    def _arrived(self, event: RequestArrived, now: float) -> list[Action]:
        full = self._full_for(event.prompt_tokens, event.max_tokens)
        candidates = self._candidates(event, now)
        last_resort = self._leaving_until is not None and self._serves_while_leaving(
            event, candidates, now)
        return list(self._lifecycle.start(event, candidates, full, last_resort))

    def _serves_while_leaving(
        self, event: RequestArrived, candidates: list[Candidate], now: float
    ) -> bool:
        """A leaving node serves a request no peer took if its admission bounds have room and
        the request's predicted latency here ends within the rest of the grace."""
        assert self._leaving_until is not None
        own = next((c for c in candidates if c.is_self), None)
        if own is None or now + own.predicted_latency_s > self._leaving_until:
            return False
        return admission(self.config.admission, self._compute.report(), self._token_rate.per_s,
                         self._load, event.prompt_tokens, event.max_tokens) is None

    def _full_for(self, prompt_tokens: int, max_tokens: int) -> float | None:
        """None if this node has room for one more request of ``prompt_tokens`` +
        ``max_tokens``; else its queue's expected wait (0 while leaving: it has no room for
        anything new, whatever its queue). The decision is :func:`admission`'s."""
        if self._leaving_until is not None:
            return 0.0
        full = admission(self.config.admission, self._compute.report(),
                         self._token_rate.per_s, self._load, prompt_tokens, max_tokens)
        if full is None:
            return None
        self._count(f"admission_full_{full.bound}")
        return full.wait_s

    def own_speed(self) -> SpeedReport:
        """This node's measured speed (what bounded admission reckons the queue's work with)."""
        return self._compute.report()

    def token_rate(self) -> float:
        """Tokens (prompt + output) per second of service of one request stream, measured."""
        return self._token_rate.per_s

    def _candidates(self, event: RequestArrived, now: float) -> list[Candidate]:
        me = Candidate(self.node_id, True, event.local_cached, 0.0)
        if event.local_only:
            return [me]
        if event.target is not None and event.target != self.node_id:
            return [Candidate(event.target, False, 0, 0.0), me]
        first = self._lifecycle.get(event.rid) is None  # not a re-ranking after a refusal
        return self.route(
            event.hashes, event.prompt_tokens, event.local_cached, event.max_tokens, now,
            observe=first, request=event.rid,
        )

    def _accepted(self, event: ForwardAccepted, _: float) -> list[Action]:
        if self._lifecycle.is_current(event.rid, event.peer_id, "accepted"):
            self._lifecycle.accepted(event.rid)
        return []

    def _refused(self, event: ForwardRefused, now: float) -> list[Action]:
        if not self._lifecycle.is_current(event.rid, event.peer_id, "refused"):
            return []
        self._count("forwards_refused")
        self._gossip.refused_forward(event.peer_id, event.retry_after_s, now)
        if event.queue_s is not None:
            self._queue_reported(event.peer_id, event.queue_s, now)
        return list(self._lifecycle.refused(event.rid, self._ranked_again(event.rid, now)))

    def _failed(self, event: ForwardFailed, now: float) -> list[Action]:
        if not self._lifecycle.is_current(event.rid, event.peer_id, "failed"):
            return []
        self._count("forwards_failed")
        actions = self._gossip.forward_failed(event.peer_id, now)
        fresh = self._ranked_again(event.rid, now)
        actions.extend(self._lifecycle.failed(event.rid, event.tokens_so_far, fresh))
        return actions

    def _ranked_again(self, rid: int, now: float) -> list[Candidate] | None:
        """The request ranked from the current view (after a refusal or a failure)."""
        flight = self._lifecycle.get(rid)
        if flight is None or flight.stage is Stage.STREAMING:
            return None  # (accepted: the answer continues here whatever the view says)
        self._lifecycle.release(rid)  # its try there no longer holds the prompt's blocks
        return self._candidates(flight.arrived, now)

    def _done(self, event: RequestDone, now: float) -> list[Action]:
        flight = self._lifecycle.get(event.rid)
        peer = None if flight is None else flight.peer
        if not self._lifecycle.is_current(event.rid, peer, "done"):
            return []
        flight = self._lifecycle.done(event.rid, event.error)
        if flight.peer is None or event.error is not None:
            return []
        if event.forward_rtt_s is not None:
            self._forward_ok(flight.peer, flight.arrived.hashes, event.forward_rtt_s)
        waited = event.forward_queue_s
        choice = flight.choice
        if waited is not None and choice is not None and choice.node_id == flight.peer:
            if 0.0 <= waited <= MAX_REPORTED_WAIT_S:  # a peer's claim: bounded
                self._wait_error(flight.peer).observe(waited - choice.wait_s, now)
                if choice.rent_key is not None:
                    self._rent_waited(choice.rent_key, waited, flight.candidates, now)
            else:
                self._count("forward_waits_rejected")
        return []

    def _rent_waited(
        self, key: int, waited: float, candidates: list[Candidate], now: float
    ) -> None:
        """A rental's queue wait at the holder, beyond the wait this node predicted for
        itself when it chose, is rent paid for the prefix's copy there (besides the round
        trip, counted when it chose): a holder that every entry node rents from becomes the
        busiest node, and its renters buy their own copies (ski rental, ``Placement.rent_s``)
        once the waits they met reach the copy's price. With the round trips alone a hot
        prefix stayed on one node of four: on the real cluster at Poisson 50 % that node
        served 58-65 % of the requests, and its queue made the hot prefix's mean 1.18-1.30x
        `none`'s (each entry node's own copy would have cost one cold prefill)."""
        own = next((c.wait_s for c in candidates if c.is_self), 0.0)
        # signed, so noise in either direction cancels; the rent never goes below 0: a burst
        # in which this node was the busier one must not block a copy for the rent's window
        paid = self._key_rent.total(key, now)
        self._key_rent.add(key, now, max(waited - own, -paid))

    def _spread_of(self, peer: str, now: float) -> float:
        err = self._wait_errors.get(peer)
        return 0.0 if err is None else err.spread(now)

    def _wait_error(self, peer: str) -> WaitError:
        """``peer``'s queue-wait prediction error, created on first use; entries of peers no
        longer routable are dropped when the table outgrows the membership."""
        err = self._wait_errors.get(peer)
        if err is None:
            routable = self._gossip.routable
            if len(self._wait_errors) > 2 * len(routable) + 16:
                self._wait_errors = {p: e for p, e in self._wait_errors.items() if p in routable}
            cfg = self.config
            err = self._wait_errors[peer] = WaitError(cfg.priors.alpha, cfg.router.error_window_s)
        return err

    def _cancelled(self, event: RequestCancelled, _: float) -> list[Action]:
        return list(self._lifecycle.cancel(event.rid))

    def _forward_arrived(self, event: ForwardArrived, now: float) -> list[Action]:
        refusal, cost, wait = self._refusal(event, now)
        verdict = "accepted" if refusal is None else "slower" if cost is not None else "busy"
        self.decisions.admitted(now, event.prompt_tokens, event.cached_tokens, event.max_tokens,
                                event.beat_s, cost, wait, self._load.queue_depth, verdict)
        return [AcceptForward(event.rid) if refusal is None else refusal]

    def _refusal(
        self, event: ForwardArrived, now: float
    ) -> tuple[RefuseForward | None, float | None, float | None]:
        """Whether to refuse a request a peer forwarded here (None: admit it), with what
        serving it here costs and the queue wait in that (None: not compared). Client requests
        entering here are always served; forwards are refused
        * by this node's state — leaving, full, at the push-back threshold — with the
          seconds the peer should leave us alone, and
        * when the sender said what we must beat (``beat_s``: its local prediction, the
          alternative to our answer — its way here is spent, the way back paid either way)
          and what serving it here costs, known exactly here (``mesh_cost``: our queue wait
          + its service, plus that service again for each request queued here, as the
          sender counted its own), is more. This node is not busy as such, so the sender
          need not leave it alone (retry after 0): the refusal tells it our queue wait
          instead (``queue_s``), a report of our queue fresher than gossip's.
        A sender routing on a view of our queue that is a gossip round old finds out in one
        round trip instead of waiting in a queue that many nodes picked at once."""
        retry = self._refusal_by_state(now, event.prompt_tokens, event.max_tokens)
        if retry is not None:
            return RefuseForward(event.rid, retry), None, None
        if event.beat_s is None:
            return None, None, None
        me = self._self_info(event.cached_tokens, now)
        req = RouteInput(max(event.prompt_tokens, 1), max(event.max_tokens, 1))
        predicted = mesh_cost(req, [me], self.config.router.context_scale)[0]
        wait = predict_wait(me)
        if predicted <= event.beat_s:
            return None, predicted, wait
        self._count("forwards_refused_slower")
        return RefuseForward(event.rid, 0.0, wait), predicted, wait

    def _refusal_by_state(self, now: float, prompt_tokens: int, max_tokens: int) -> float | None:
        """Refusals by this node's state: leaving, full (for this request's tokens: bounded
        admission), or at the push-back threshold."""
        adm = self.config.admission
        if self._leaving_until is not None:
            self._count("forwards_refused_leaving")
            cap = self.config.gossip.exchange.max_retry_after_s
            return min(max(self._leaving_until - now, adm.min_retry_after_s), cap)
        full = self._full_for(prompt_tokens, max_tokens)
        if full is not None:
            self._count("forwards_refused_full")
            return max(full, adm.min_retry_after_s)
        pb = self.config.pushback
        if self._pushes_back_at(self._load.queue_depth + 1):  # one more would be over
            self._count("forwards_refused_busy")
            until = self._pushback_until
            return pb.duration_s if until is None or until <= now else until - now
        return None

    def _refresh_stale_speed(self, now: float) -> None:
        """An own speed estimate no request has refreshed for a load window (this node idle)
        starts again from the median speed of the routable peers that served lately, and
        so do its peers' views of it (its next load report carries it). A node that learnt
        a slow speed from a few requests served while the machine was oversubscribed would
        otherwise keep it for good: it looks too slow to itself and to its peers, is sent
        nothing, and never measures again (on the real cluster such a node served nothing
        for whole runs, its engine idle while its peers queued). A node really slower than
        the median is sent a request or two, and they bring its estimate back.
        A node that has measured nothing yet (its speed is the configured prior) adopts the
        peers' median at the first round after one of them has served, not a window later:
        the default prior is the tiny engine's on an idle machine, and a node still
        advertising it looked 4-5x faster than peers that had measured a loaded one, so in a
        run's first seconds cold copies went to the nodes that had served nothing (one
        client in the simulator with the fitted speeds: 2 agent tasks' steps copied cold
        to an idle node next to the holder of 1,456 of their 1,664 tokens). It does so while
        busy too: a node whose first requests are long cold prefills measures nothing until
        they end, and meanwhile its prior made it the cheapest queue in the mesh (real
        cluster, MMLU with 16 clients: in a run's first 5 s, five requests of new subjects
        went to the one node still prefilling its first prompt, 2,496 tokens, and waited
        13-28 s there; the other three had measured theirs)."""
        window = self.config.router.load_window_s
        if not speed_is_stale(self._speed_at, self._load.queue_depth > 0, now, window):
            return
        if self._speed_at is not None:
            self._speed_at = now  # (checked again a window later)
        fresh = []  # the speeds of (at most SPEED_SAMPLE) peers that served lately
        for peer in self._gossip.routable:
            est = self._gossip.estimates.get(peer)
            if est is None or est.speed is None or est.speed_measured_at is None:
                continue
            if now - est.speed_measured_at < window:
                fresh.append(est.speed)
                if len(fresh) >= SPEED_SAMPLE:
                    break
        if self._compute.restart_from(fresh):
            self._speed_at = now
            self._load_cache = None
            self._count("speed_adopted")

    def _served(self, event: RequestServed, now: float) -> list[Action]:
        self._count("requests_served")
        self._speed_at = self._measured_at = now
        self._load_cache = None
        uncached = max(0, event.prompt_tokens - event.cached_tokens)
        self._compute.observe_prefill(uncached, event.cached_tokens, event.prefill_s)
        self._compute.observe_decode(event.decode_tokens, event.decode_s)
        self._compute.observe_service(event.service_s)
        self._token_rate.observe(event.prompt_tokens + event.decode_tokens, event.service_s)
        return []

    def _forward_ok(self, peer: str, hashes: tuple[int, ...], rtt_s: float) -> None:
        """A peer answered a forward: an RTT sample, and it now holds the request's prefix."""
        self._count("forwards_succeeded")
        self._rtt.observe(peer, rtt_s)
        est = self._gossip.estimates.get(peer)
        if est is not None and est.version is not None and hashes:
            self._view.optimistic_insert(peer, hashes)

    def _own_load(self, now: float) -> Load:
        """This node's load as advertised now (cached while no push-back is running)."""
        busy = round(self._busy.value(now), 2)  # 0.01 steps: the cache survives idle decay
        pushback = self._pushback_left(now)
        if pushback is not None:
            return self._make_load(pushback, busy)
        cached = self._load_cache
        if cached is None or cached.utilization != busy:
            cached = self._load_cache = self._make_load(None, busy)
        return cached

    def _pushback_left(self, now: float) -> float | None:
        """Seconds peers should back off now (None: not at all): a queue over the threshold,
        or leaving (the rest of the grace, at least one push-back duration)."""
        until = self._pushback_until
        left = until - now if until is not None and until > now else None
        if self._leaving_until is not None:
            leave = max(self._leaving_until - now, self.config.pushback.duration_s)
            left = leave if left is None else max(left, leave)
        return left

    def _make_load(self, pushback: float | None, busy: float) -> Load:
        ev = self._load
        speed = self._compute.report()
        return Load(ev.queue_depth, ev.inflight, ev.cache_tokens, ev.cache_budget, speed,
                    pushback, busy, self._measured_at)

    def _account_out(self, actions: list[Action]) -> list[Action]:
        for a in actions:
            payload = getattr(a, "payload", None)
            if isinstance(payload, bytes):
                self._count("gossip_messages_out")
                self._count("gossip_bytes_out", len(payload))
        return actions

    # -------------------------------------------------------------------------- routing
    def route(
        self,
        hashes: Sequence[int],
        prompt_tokens: int,
        local_cached_tokens: int,
        max_tokens: int,
        now: float,
        observe: bool = False,
        request: int | None = None,
    ) -> list[Candidate]:
        """Rank self and the available peers for one request (head = choice); ``observe``:
        count the request in its prefix's rate (its first ranking, not a re-ranking);
        ``request``: its number here, to keep the decision in ``decisions``."""
        self._count("routes")
        req = RouteInput(prompt_tokens, max_tokens)
        policy = self.config.router.policy
        nodes = [self._self_info(local_cached_tokens, now)]
        placed = None
        if policy is not Policy.NONE:
            peers = self._peer_infos(hashes, prompt_tokens, policy, now)
            nodes.extend(peers)
            if policy is Policy.COST:
                placed = self._placement(hashes, req, nodes, now, observe)
        placement, key = placed if placed is not None else (None, None)
        ranked = self._router.rank(req, nodes, self._rng, placement)
        if policy is Policy.COST and not self._rtt.known:
            # no round trip measured yet (no gossip echo): the prior's guess of this network
            # is no ground to send a request away on, so this node comes first; the peers
            # stay behind it for what it cannot serve (full, leaving)
            ranked.sort(key=lambda c: not c.is_self)  # stable: the peers keep their order
        head = ranked[0]
        if observe and key is not None:
            mine = next(c for c in ranked if c.is_self)
            # renting a copy: a hit there, not here, predicted faster than staying (a forward
            # the placement slack chose, slower than staying, avoids a second copy: no rent)
            if (head.placement is Tag.HIT and mine.placement is not Tag.HIT
                    and head.predicted_latency_s < mine.predicted_latency_s):
                rtt = next((n.rtt_s for n in nodes if n.node_id == head.node_id), 0.0)
                self._key_rent.add(key, now, rtt)  # the round trip it spends; the wait it
                ranked[0] = replace(head, rent_key=key)  # meets there is added when done
        if request is not None:
            self.decisions.record(now, request, not observe, prompt_tokens, max_tokens, nodes,
                                  placement, ranked)
        return ranked

    def _placement(
        self,
        hashes: Sequence[int],
        req: RouteInput,
        nodes: list[NodeInfo],
        now: float,
        observe: bool = False,
    ) -> tuple[Placement, int] | None:
        """The request's prefix's owner set on the ring (owners missing from ``nodes`` are
        appended): as many owners as its load here says it needs (``core/placement.py``);
        with the placement key that names the prefix."""
        cfg = self.config.router
        if cfg.placement_depth_blocks is None or not hashes:
            return None
        block = self.config.fingerprint.block_size
        depth = placement_depth(len(hashes), cfg.placement_depth_blocks,
                                self._shared_blocks(hashes, nodes[0].cached_tokens // block))
        key = hashes[depth - 1]
        if observe:
            self._key_rates.add(key, now)  # one request
        held = depth * block
        self._update_ring(now)
        members = len(self._ring)
        # a warm request's service here: what one replica spends on each of the key's
        # requests, with what its best holder holds of this one cached (not just the key's
        # blocks: an MMLU prompt past its subject's key is a cold prefill's worth, and
        # priced so every subject looked 5x as hot as it was)
        reused = min(max(held, *(n.cached_tokens for n in nodes)), req.prompt_tokens - 1)
        warm = nodes[0].speed.service_s(
            max(req.prompt_tokens - reused, 1), reused, req.max_tokens, cfg.context_scale,
        )
        load = self._key_rates.confident_rate(key, now) * members * warm
        k = replicas_for(load, cfg.replica_load, members, cfg.max_replicas)
        owners = self._owners(key, k, nodes, now)
        if len(owners) > 1:
            owners = self._owners_needed(owners, nodes, now)
        present = {n.node_id for n in nodes}
        missing = [o for o in owners if o not in present]
        if len(missing) > ROUTE_TOP_K:  # a very hot prefix: a random few of its owners (entry
            missing = self._rng.sample(missing, ROUTE_TOP_K)  # nodes differ: load spreads)
        for owner in missing:
            if owner not in present:
                cached = min(self._view.depth_of(owner, hashes) * block, req.prompt_tokens)
                info = self._info(owner, cached, now)
                if info is not None:
                    nodes.append(info)
        return Placement(tuple(owners), held, self._key_rent.total(key, now)), key

    def _owners_needed(self, owners: list[str], nodes: list[NodeInfo], now: float) -> list[str]:
        """A hot prefix's owners past the first are for requests that would wait: the set
        ends at the first owner where a request arriving now is expected to find an empty
        queue (own queue exact, a peer's expected one). The owner sets stay nested, so two
        entry nodes that disagree still agree on the owners they share. A prefix's load
        counts its requests, not whether they overlap: one client sending a hot prefix
        back to back keeps one node ~90 % busy with nothing ever queued, and its load asked
        for 2-3 owners; each replica was a cold prefill that no request waited less for
        (the real cluster's one-client hot-prefix run: 2 of 100 requests, two of its four
        slowest)."""
        known = {n.node_id: n for n in nodes}
        for i, owner in enumerate(owners[:-1]):
            info = known.get(owner) or self._info(owner, 0, now)
            if info is None or info.queue_depth < 1.0:
                return owners[: i + 1]
        return owners

    def _owners(self, key: int, k: int, nodes: list[NodeInfo], now: float) -> list[str]:
        """The key's first ``k`` owners clockwise among the available members, passing over
        those busier than ``placement_load_bound`` allows (self included; the mean
        utilization is that of ``nodes``, the candidates): consistent hashing with bounded
        load, without the forward bound's slack. A busy member keeps what it holds; new
        prefixes go past it, to the same member from every entry node whose view of the load
        agrees. The ring's arcs and the prefixes' popularity are uneven (on the real cluster
        one node of four owned 30 % of the ring and served 40 % of MMLU's requests, every
        subject where it was first put)."""
        def alive(m: str) -> bool:
            return m == self.node_id or self.available(m, now)

        cfg = self.config.router
        bound = cfg.placement_load_bound
        mean = mean_utilization([n for n in nodes if n.available])
        if bound is None or mean <= 0.0:  # nobody can be over the bound: the plain walk
            return self._ring.owners(key, k, alive)
        known = {n.node_id: n for n in nodes}

        def room(m: str) -> bool:
            if not alive(m):
                return False
            info = known.get(m) or self._info(m, 0, now)
            return info is None or not over_bound(info, mean, bound)  # no slack (request_slack)

        return self._ring.owners(key, k, room) or self._ring.owners(key, k, alive)

    def _shared_blocks(self, hashes: Sequence[int], mine: int) -> int:
        """Blocks of this request's prefix that every member holds (self exactly, peers in
        the view): a header common to all prompts, such as a chat preamble or an agent's
        system prompt, which must not name the prefix. 0 in meshes too large to check every
        member per request (the fixed depth alone names the prefix there)."""
        routable = self._gossip.routable
        if not routable or len(routable) >= SHARED_CHECK_MAX:
            return 0
        shared = mine
        for member in routable:
            if shared == 0:
                break
            shared = min(shared, self._view.depth_of(member, hashes))
        return shared

    def _update_ring(self, now: float) -> None:
        """The ring over the routable members and self: O(members) to check, so checked when
        their count changes and otherwise once per gossip round (membership changes slower)."""
        routable = self._gossip.routable
        if len(routable) + 1 != len(self._ring) or now >= self._ring_checked:
            self._ring.update((*routable, self.node_id))
            self._ring_checked = now + self.config.gossip.interval_s

    def _self_info(self, cached_tokens: int, now: float) -> NodeInfo:
        """This node as the router sees it: exact cache match, own queue, own speed; each
        place in its queue priced by its queued tokens (exact here; a peer's queue is priced
        at its mean service: gossiping this price was tried, and a report describes a queue
        that is gone when the forward lands — worse in the simulator)."""
        ev = self._load
        speed = self._compute.report()
        per_place = speed.queued_service_s(
            ev.queue_depth, ev.queue_prompt_tokens, ev.queue_uncached_tokens,
            ev.queue_output_tokens, self.config.router.context_scale)
        return NodeInfo(
            self.node_id,
            True,
            cached_tokens,
            0.0,
            ev.queue_depth,
            speed,
            utilization=self._busy.value(now),
            queue_service_s=per_place,
        )

    def _peer_infos(
        self, hashes: Sequence[int], prompt_tokens: int, policy: Policy, now: float
    ) -> list[NodeInfo]:
        if policy in (Policy.PAPER, Policy.COST):
            skip = _Unavailable(self, now)
            matched = dict(self._view.match_top(hashes, ROUTE_TOP_K, self._rng, skip))
            ids = list(matched)
            if policy is Policy.COST:
                self._in_flight_blocks(hashes, matched, ids, skip)
                ids.extend(p for p in self._least_loaded(now) if p not in matched)
        else:  # baselines consider every node anyway
            matched = self._view.match(hashes)
            ids = list(self._gossip.routable)
        block = self.config.fingerprint.block_size
        out = []
        for peer in ids:
            info = self._info(peer, min(matched.get(peer, 0) * block, prompt_tokens), now)
            if info is not None:
                out.append(info)
        return out

    def _in_flight_blocks(
        self, hashes: Sequence[int], matched: dict[str, int], ids: list[str], skip: _Unavailable
    ) -> None:
        """Peers our forwards in flight are computing this request's prefix at: they hold
        it for this request (it queues behind them) though no gossip has said so yet; into
        ``matched`` (blocks) and ``ids`` (candidates). Two requests of a new prefix entering
        here a moment apart went to two nodes, each a cold prefill, whenever the first one's
        node had a queue (the peer's gossip of its queued blocks comes a round later)."""
        lifecycle = self._lifecycle
        for peer in lifecycle.peers_with_blocks():
            blocks = lifecycle.blocks_at(peer, hashes)
            if blocks > matched.get(peer, 0) and peer not in skip:
                if peer not in matched:
                    ids.append(peer)
                matched[peer] = blocks

    def _info(self, peer: str, cached_tokens: int, now: float) -> NodeInfo | None:
        est = self._gossip.estimates.get(peer)
        if est is None or not self._available(peer, est, now) or est.load is None:
            return None
        load = est.load
        speed = est.speed or self._prior_speed
        return NodeInfo(
            peer,
            False,
            cached_tokens,
            self._rtt.get(peer),
            self._expected_queue(peer, load.queue_depth, speed.mean_service_s, now),
            speed,
            utilization=load.utilization,
            wait_error_s=self._spread_of(peer, now),
        )

    def _expected_queue(self, peer: str, reported: int, service_s: float, now: float) -> float:
        """The queue a request sent to ``peer`` now should expect: its report, which others'
        concurrent choices make stale within a few service times (it relaxes towards the
        mean of all peers' reports, with time constant ``queue_memory`` × its mean service),
        plus our own forwards to it that the report cannot have counted. The latest report
        is its gossip's or the queue wait it gave when it last refused us, whichever is newer
        (``_queue_reported``). (Taking off the forwards the report counted that have ended
        since was tried: exact, yet the estimate got worse, since the same report's age
        also hides others' forwards; refused forwards per request at 16 simulated nodes,
        one client each, 0.114 / 0.106 -> 0.129 / 0.126.)"""
        seen = self._load_seen.get(peer)
        if seen is None:
            return float(reported)
        ours = self._lifecycle.forwards_since(peer, seen.sent)
        mean = self._peers_mean_queue()
        memory = self.config.router.queue_memory * max(service_s, 1e-6)
        kept = math.exp(-max(now - seen.at, 0.0) / memory)
        return mean + (seen.depth - mean) * kept + ours

    def available(self, peer: str, now: float) -> bool:
        """Whether ``peer`` may be routed to now (alive, reporting load, not pushed back)."""
        est = self._gossip.estimates.get(peer)
        return est is not None and self._available(peer, est, now)

    def _available(self, peer: str, est: Estimate, now: float) -> bool:
        if peer not in self._gossip.routable:
            return False
        return est.pushback_until is None or est.pushback_until <= now

    def _least_loaded(self, now: float) -> list[str]:
        """Up to IDLE_PEERS available peers with the lowest gossiped queue depth."""
        found: list[str] = []
        keep: list[tuple[int, float, str]] = []
        while self._idle and len(found) < IDLE_PEERS:
            entry = heapq.heappop(self._idle)
            depth, stamp, peer = entry
            est = self._gossip.estimates.get(peer)
            if (
                est is None
                or est.load is None
                or est.stamp != stamp
                or depth != est.load.queue_depth
            ):
                continue  # superseded by a newer report: drop for good
            if peer not in self._gossip.routable:
                continue  # re-pushed when it reports again
            keep.append(entry)
            if self._available(peer, est, now) and peer not in found:
                found.append(peer)
        for entry in keep:
            heapq.heappush(self._idle, entry)
        return found

    def _trim_idle(self) -> None:
        if len(self._idle) > 4 * max(16, len(self._gossip.estimates)):
            fresh = []
            for depth, stamp, peer in self._idle:
                est = self._gossip.estimates.get(peer)
                if est is not None and est.load is not None and est.stamp == stamp:
                    fresh.append((depth, stamp, peer))
            heapq.heapify(fresh)
            self._idle = fresh

    # ------------------------------------------------------------------------ inspection
    def peer_address(self, peer_id: str) -> str | None:
        member = self._members.get(peer_id)
        return None if member is None else member.address

    def local_hashes(self) -> frozenset[int]:
        """The block hashes this node advertises (its own summary: what its engine caches
        and what its queued requests compute)."""
        return self._summary.hashes()

    def cached_hashes(self) -> frozenset[int]:
        """The block hashes this node's engine caches, as its cache events said: its own
        summary less the blocks advertised only because a queued request computes them."""
        return self._summary.hashes() - self._holdings.queued_only()

    def estimate(self, peer_id: str) -> frozenset[int]:
        """The block hashes this node believes ``peer_id`` holds (empty if none)."""
        return self._view.held(peer_id)

    @property
    def summary_version(self) -> int:
        """The version of this node's own cache summary (grows with each cache change)."""
        return self._summary.version

    def placement_of(self, rid: int) -> Tag | None:
        """The router's placement tag of the current try of request ``rid`` here (None: not
        in flight, or no placement: not the cost policy)."""
        flight = self._lifecycle.get(rid)
        return None if flight is None or flight.choice is None else flight.choice.placement

    def routable_count(self) -> int:
        """Peers this node would route to now (alive, with a load report)."""
        return len(self._gossip.routable)

    def view_version(self, peer_id: str) -> int | None:
        """Version of ``peer_id``'s summary this node holds (None: none)."""
        est = self._gossip.estimates.get(peer_id)
        return None if est is None else est.version

    def peer_state(self, peer_id: str) -> str | None:
        """``"alive"``, ``"suspect"``, ``"dead"`` or None if unknown."""
        member = self._members.get(peer_id)
        return None if member is None else member.state.value

    def pushed_back(self, peer_id: str, now: float) -> bool:
        """Whether ``peer_id`` asked us to back off and that time has not passed."""
        est = self._gossip.estimates.get(peer_id)
        until = None if est is None else est.pushback_until
        return until is not None and until > now

    def metrics(self) -> dict[str, float]:
        """Flat counters and gauges (names are stable: the runtime exports them)."""
        out = dict(self._metrics)
        out["peers_alive"] = float(self._members.count(MemberState.ALIVE))
        out["peers_suspect"] = float(self._members.count(MemberState.SUSPECT))
        out["peers_dead"] = float(self._members.count(MemberState.DEAD))
        out["peers_routable"] = float(len(self._gossip.routable))
        out["view_peers"] = float(len(self._view.peers()))
        out["view_entries"] = float(self._view.total_entries())
        out["summary_version"] = float(self._summary.version)
        out["summary_blocks"] = float(len(self._summary))
        out["incarnation"] = float(self.incarnation)
        out["queue_depth"] = float(self._load.queue_depth)
        out["leaving"] = float(self.leaving)
        out.update(self._lifecycle_metrics())
        return out

    def _lifecycle_metrics(self) -> dict[str, float]:
        lc = self._lifecycle.counters
        out = {
            "requests_in_flight": float(len(self._lifecycle)),
            "forwards_unknown_peer": float(lc.unknown_peer),
            "lifecycle_stale_events": float(lc.stale),
            "requests_cancelled": float(lc.cancelled),
            "requests_failed": float(lc.failed),
            "requests_rejected": float(lc.rejected),
        }
        for route in ("local", "forwarded", "fallback"):
            out[f"requests_{route}"] = float(lc.routes.get(route, 0))
        # cost: who served each request, by the router's placement tag (core/router.Tag):
        # placement_second_copy = accidental cold copies of a prefix cached elsewhere (in the
        # view) at decision time; placement_replica = deliberate hot-prefix replicas;
        # placement_local_copy = copies kept at the entry once forwarding cost more (rent)
        for tag in Tag:
            out[f"placement_{tag.value}"] = float(lc.placements.get(tag.value, 0))
        return out

    def mesh_state(self, now: float) -> dict[str, object]:
        """JSON-able view of this node's mesh, for ``GET /mesh``."""
        until = self._pushback_until
        return {
            "node_id": self.node_id,
            "address": self.config.address,
            "incarnation": self.incarnation,
            "fingerprint": f"{self.config.fingerprint.digest:016x}",
            "gossip_mode": self.config.gossip.mode.value,
            "version": self._summary.version,
            "blocks": len(self._summary),
            "queue_depth": self._load.queue_depth,
            "pushback_remaining_s": None if until is None else max(0.0, until - now),
            "leaving": self.leaving,
            "seeds": list(self._members.seeds),
            "peers": [self._peer_state(m.node_id, now) for m in self._members],
        }

    def _peer_state(self, peer: str, now: float) -> dict[str, object]:
        member = self._members.get(peer)
        est = self._gossip.estimates[peer]
        assert member is not None
        load = est.load
        speed = est.speed or self._prior_speed
        until = est.pushback_until
        return {
            "node_id": peer,
            "address": member.address,
            "state": member.state.value,
            "incarnation": est.incarnation,
            "view_version": est.version,
            "view_blocks": self._view.size(peer),
            "age_s": max(0.0, now - member.last_heard),
            "heartbeat": est.heartbeat,
            "load": None
            if load is None
            else {
                "queue_depth": load.queue_depth,
                "inflight": load.inflight,
                "cache_tokens": load.cache_tokens,
                "cache_budget": load.cache_budget,
                "prefill_s_per_token": speed.prefill_s_per_token,
                "decode_s_per_token": speed.decode_s_per_token,
                "mean_service_s": speed.mean_service_s,
            },
            "pushback_remaining_s": None if until is None else max(0.0, until - now),
            "rtt_s": self._rtt.get(peer),
            "rtt_measured": self._rtt.measured(peer),
            "wait_error_s": self._spread_of(peer, now),
        }

    def _count(self, name: str, by: float = 1.0) -> None:
        self._metrics[name] = self._metrics.get(name, 0.0) + by


# ------------------------------------------------------------------------ bounded admission
class TokenRate:
    """Tokens (prompt + output) this node's engine gets through per second of service, per
    request stream: a ratio of two EWMAs (tokens per request, seconds per request), so long
    requests weigh as much as they cost. Cached prompt tokens count at what they really cost
    (next to nothing): the rate is the workload's own mix, measured. The prior: a request of
    256 uncached prompt tokens and 16 output tokens at the prior speeds."""

    PRIOR_PROMPT, PRIOR_OUTPUT = 256, 16

    def __init__(self, priors: CostPriors) -> None:
        prior_s = SpeedReport(priors.prefill_overhead_s, priors.prefill_s_per_token,
                              priors.decode_s_per_token, 0.0).service_s(
            self.PRIOR_PROMPT, 0, self.PRIOR_OUTPUT, priors.context_scale)
        self._tokens = Ewma(float(self.PRIOR_PROMPT + self.PRIOR_OUTPUT), priors.alpha)
        self._seconds = Ewma(max(prior_s, 1e-6), priors.alpha)

    def observe(self, tokens: int, service_s: float) -> None:
        if tokens > 0 and service_s > 0:
            self._tokens.observe(float(tokens))
            self._seconds.observe(service_s)

    @property
    def per_s(self) -> float:
        return self._tokens.value / max(self._seconds.value, 1e-9)


@dataclass(frozen=True, slots=True)
class Full:
    """:func:`admission`'s answer for a node without room: its queue's expected wait (the
    retry-after's base) and the bound that was reached (``requests``, ``wait``, ``tokens``)."""

    wait_s: float
    bound: str


def token_cap(adm: AdmissionConfig, tokens_per_s: float, streams: int = 1) -> int | None:
    """The token bound in force: ``max_queue_tokens``, or (0, the default) the tokens the
    engine gets through within ``max_queue_wait_s`` at its measured rate (``tokens_per_s``
    per request stream, times the ``streams`` it runs at once: a batching engine's running
    requests; at least 1); None: no token bound."""
    if adm.max_queue_tokens is None or adm.max_queue_tokens > 0:
        return adm.max_queue_tokens
    return int(adm.max_queue_wait_s * max(tokens_per_s, 0.0) * max(streams, 1))


def admission(adm: AdmissionConfig, speed: SpeedReport, tokens_per_s: float,
              load: LoadChanged, prompt_tokens: int, max_tokens: int) -> Full | None:
    """Bounded admission, the whole decision: None if a node with ``load`` (and this speed)
    has room for one more request of ``prompt_tokens`` + ``max_tokens``, else :class:`Full`.

    An idle node (nothing waiting or running) always has room: a request larger than every
    bound must still run somewhere. Otherwise the node is full when its queue
    * holds ``max_queue_requests`` requests, or
    * would keep the request waiting ``max_queue_wait_s`` (depth x mean service), or
    * with this request would hold more tokens (prompt + max_tokens of every request waiting
      or running) than :func:`token_cap`: ``max_queue_tokens``, or by default the tokens the
      engine gets through within ``max_queue_wait_s`` at its measured rate.
    The wait reported is the larger of the two estimates of the queue's work (its requests
    at the mean service time, its tokens at the measured rate)."""
    depth = load.queue_depth
    if depth <= 0:
        return None
    streams = max(load.inflight, 1)
    queued = load.queue_prompt_tokens + load.queue_output_tokens
    wait = depth * speed.mean_service_s
    reported = max(wait, queued / max(tokens_per_s * streams, 1e-9))
    if adm.max_queue_requests is not None and depth >= adm.max_queue_requests:
        return Full(reported, "requests")
    if wait >= adm.max_queue_wait_s:
        return Full(reported, "wait")
    cap = token_cap(adm, tokens_per_s, streams)
    if cap is not None and queued + max(prompt_tokens, 0) + max(max_tokens, 0) > cap:
        return Full(reported, "tokens")
    return None
