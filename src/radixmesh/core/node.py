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
      engine died / came back         ── EngineStateChanged ▶ no new work while down, round
      a DNS name resolved again       ── SeedsDiscovered ▶ greet new seed addresses
                                      ◀── Send / Log / PeerStateChanged / request actions

``NodeCore`` is a facade: it holds references to its parts and dispatches each event to the
one that owns the concern, and each part owns its state (no part reads another's private
attributes; ``tests/test_layering.py`` checks)::

    gossip.py      Gossiper          membership, failure detection, the view's updates
    rounds.py      GossipRounds      when to gossip, decoding, bytes in and out, seeds
    own_load.py    OwnLoad           own load, speed, token rate, advertised load
    peer_loads.py  PeerLoads         peers' expected queues, availability, wait errors
    admission.py   AdmissionControl  push-back, bounded admission, leaving, peers' forwards
    placer.py      Placer            a prefix's key, owner set (ring) and rent
    routing.py     Routing           a request's candidates, ranked (``Router``), recorded
    lifecycle.py   Lifecycle         a request's tries at its entry node
    requests.py    RequestFlow       request events: lifecycle + what the others learn
    node_report.py NodeReport        metrics and ``/mesh``

docs/modules.md has the table "decision → the core function that makes it".

Only the shell owns a clock; ``now`` is seconds on the shell's clock and is never compared
across nodes (push-back durations and RTT echoes are relative). Randomness comes from the
``random.Random`` given at construction (gossip jitter, target sampling, router tie-breaks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from random import Random  # the type only: instances are passed in, never the global one
from typing import Any

from radixmesh.core.adapters import Adapter, resolve
from radixmesh.core.config import NodeConfig
from radixmesh.core.cost_model import Candidate, Tag
from radixmesh.core.decisions import DecisionLog
from radixmesh.core.estimators import SpeedReport
from radixmesh.core.events import (
    AcceptForward,
    Action,
    CacheChanged,
    EngineStateChanged,
    Event,
    ForwardAccepted,
    ForwardArrived,
    ForwardFailed,
    ForwardRefused,
    LeaveRequested,
    LoadChanged,
    MessageReceived,
    QueueChanged,
    RequestArrived,
    RequestCancelled,
    RequestDone,
    RequestEvent,
    RequestServed,
    SeedsDiscovered,
    Tick,
)
from radixmesh.core.parts import build_parts
from radixmesh.core.sessions import observe_sessions

_COUNTERS = (
    "gossip_bytes_in",
    "gossip_bytes_out",
    "gossip_messages_in",
    "gossip_messages_out",
    "gossip_rounds",
    "gossip_rounds_announced",  # rounds brought forward by a change to our cache or queue
    "messages_rejected",
    "messages_rejected_decode",
    "messages_rejected_size",
    "messages_rejected_version",
    "messages_rejected_fingerprint",
    "messages_rejected_stale",
    "messages_rejected_self",
    "messages_rejected_unverified",  # no address and fingerprint, from a sender not known
    "gossip_snapshots_applied",
    "gossip_deltas_applied",
    "gossip_stale_summaries",
    "gossip_gaps",
    "gossip_snapshot_fallbacks",
    "gossip_relays_from_future",  # a relayed state stamped far ahead of its node's clock
    "gossip_future_stamps_dropped",  # a held stamp far ahead of the peer's own next message
    "gossip_views_over_limit",  # a peer's summary grew past one snapshot's worth (dropped)
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
    "forwards_refused_engine_down",  # ... and because its engine is down
    "engine_went_down",  # EngineStateChanged: the engine went down
    "engine_came_back",  # ... came back
    "seeds_discovered",  # new seed addresses learnt after start (DNS)
    "requests_served",
    "speed_adopted",  # an own speed estimate gone stale restarted from the peers' median
    "routes",
    "pushback_started",
)


class NodeCore:
    """One node: a facade over its parts, which the shells drive with events."""

    def __init__(self, config: NodeConfig, rng: Random, now: float) -> None:
        self.config = config
        self.decisions = DecisionLog(config.decision_log)  # its recent routing decisions
        # the lifecycle asks the node for addresses (a shell may answer for it: tests do)
        self._parts = parts = build_parts(config, rng, now, self.decisions, _COUNTERS,
                                          lambda peer: self.peer_address(peer))
        requests, rounds = parts.requests, parts.rounds
        self._handlers: dict[type, Callable[[Any, float], list[Action]]] = {
            Tick: rounds.tick,
            MessageReceived: rounds.receive,
            CacheChanged: rounds.cache_changed,
            QueueChanged: rounds.queue_changed,
            LoadChanged: self._load_changed,
            RequestServed: self._served,
            RequestArrived: requests.arrived,
            ForwardAccepted: requests.accepted,
            ForwardRefused: requests.refused,
            ForwardFailed: requests.failed,
            RequestDone: requests.done,
            RequestCancelled: requests.cancelled,
            ForwardArrived: self._forward_arrived,
            LeaveRequested: self._leave,
            EngineStateChanged: self._engine_state,
            SeedsDiscovered: rounds.seeds_discovered,
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
        """Whether ``LeaveRequested`` arrived: no new work is taken (``core/admission.py``)."""
        return self._parts.admission.leaving

    # --------------------------------------------------------------------------- events
    def handle(self, event: Event, now: float) -> list[Action]:
        """Apply one event; returns the actions the shell must carry out."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"unknown event {event!r}")  # a bug in the shell, not a peer
        actions = handler(event, now)
        if isinstance(event, RequestEvent):  # (tenants) where each session goes
            observe_sessions(self._parts.sessions, self._session_of, actions, now)
        return actions

    def _session_of(self, rid: int) -> int | None:
        flight = self._parts.lifecycle.get(rid)
        return None if flight is None else flight.arrived.session

    def _forward_arrived(self, event: ForwardArrived, now: float) -> list[Action]:
        actions = self._parts.admission.forward_arrived(event, now)
        if event.session is not None and any(isinstance(a, AcceptForward) for a in actions):
            self._parts.sessions.served(event.session, now)
        return actions

    def serve(self, event: Event, now: float) -> list[Action]:
        """``handle`` for a server that must keep running (the runtime): a part that raises
        (a bug) is answered with ``CoreFailed``, not raised, and an event whose shell awaits
        a request's next step always gets one (``RequestFlow.next_step``: never a lost
        request). The simulator and tests call ``handle``, so that bugs surface there."""
        requests = self._parts.requests
        try:
            actions = self.handle(event, now)
        except Exception as exc:  # a bug in a part: the node keeps serving
            return requests.after_error(event, exc)
        return requests.next_step(event, actions)

    def next_deadline(self) -> float:
        """When the next Tick is due (the shell's clock)."""
        return self._parts.rounds.next_deadline()

    def _load_changed(self, event: LoadChanged, now: float) -> list[Action]:
        """Own load (``OwnLoad``), then push-back (``AdmissionControl``), advertised at once."""
        self._parts.own.load_changed(event, now)
        self._parts.rounds.batch_changed(self._parts.own.batch(now), now)
        log = self._parts.admission.pushback(event.queue_depth, now)
        if log is None:
            return []
        self._parts.rounds.advertise_now(now)  # the shell ticks us immediately
        return [log]

    def _served(self, event: RequestServed, now: float) -> list[Action]:
        self._parts.own.served(event, now)
        return []

    def _leave(self, event: LeaveRequested, now: float) -> list[Action]:
        """Stop taking new work and tell every peer now (push-back for the grace period)."""
        log = self._parts.admission.leave(event.grace_s, now)
        if log is None:
            return []
        return [log, *self._parts.rounds.round(now)]  # the push-back goes out in this round

    def _engine_state(self, event: EngineStateChanged, now: float) -> list[Action]:
        """The engine went down or came back: tell every peer now (push-back while down)."""
        log = self._parts.admission.engine_state(event.up, event.reason)
        if log is None:
            return []
        return [log, *self._parts.rounds.round(now)]

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
        """Rank self and the available peers for one request (``Routing.route``)."""
        return self._parts.routing.route(hashes, prompt_tokens, local_cached_tokens,
                                         max_tokens, now, observe, request)

    def adapter(self, name: str, own: Mapping[str, Adapter], pin: str | None = None
                ) -> Adapter:
        """The adapter a request naming ``name`` runs with, here or at a peer
        (core/adapters.py ``resolve``: UnknownAdapter, AmbiguousAdapter)."""
        gossip = self._parts.gossip
        return resolve(name, own, gossip.dissemination.adapters, gossip.routable, pin)

    def adapter_names(self) -> set[str]:
        """The adapter names live peers serve now (learned from gossip)."""
        known = self._parts.gossip.dissemination.adapters
        return set() if known is None else known.names(self._parts.gossip.routable)

    def available(self, peer: str, now: float) -> bool:
        """Whether ``peer`` may be routed to now (alive, reporting load, not pushed back)."""
        return self._parts.peers.available(peer, now)

    def own_speed(self) -> SpeedReport:
        """This node's measured speed (what bounded admission reckons the queue's work with)."""
        return self._parts.own.speed()

    def token_rate(self) -> float:
        """Tokens (prompt + output) per second of service of one request stream, measured."""
        return self._parts.own.token_rate()

    def streams(self, now: float) -> float:
        """Requests this node's engine serves at once, measured (``OwnLoad.streams``)."""
        return self._parts.own.streams(now)

    # ------------------------------------------------------------------------ inspection
    def peer_address(self, peer_id: str) -> str | None:
        return self._parts.report.members.address_of(peer_id)

    def local_hashes(self) -> frozenset[int]:
        """The block hashes this node advertises (its own summary: what its engine caches
        and what its queued requests compute)."""
        return self._parts.report.summary.hashes()

    def cached_hashes(self) -> frozenset[int]:
        """The block hashes this node's engine caches, as its cache events said: its own
        summary less the blocks advertised only because a queued request computes them."""
        report = self._parts.report
        return report.summary.hashes() - report.holdings.queued_only()

    def estimate(self, peer_id: str) -> frozenset[int]:
        """The block hashes this node believes ``peer_id`` holds (empty if none)."""
        return self._parts.report.view.held(peer_id)

    @property
    def summary_version(self) -> int:
        """The version of this node's own cache summary (grows with each cache change)."""
        return self._parts.report.summary.version

    def placement_of(self, rid: int) -> Tag | None:
        """The router's placement tag of the current try of request ``rid`` here (None: not
        in flight, or no placement: not the cost policy)."""
        flight = self._parts.lifecycle.get(rid)
        return None if flight is None or flight.choice is None else flight.choice.placement

    def routable_count(self) -> int:
        """Peers this node would route to now (alive, with a load report)."""
        return len(self._parts.gossip.routable)

    def view_version(self, peer_id: str) -> int | None:
        """Version of ``peer_id``'s summary this node holds (None: none)."""
        est = self._parts.gossip.estimates.get(peer_id)
        return None if est is None else est.version

    def peer_state(self, peer_id: str) -> str | None:
        """``"alive"``, ``"suspect"``, ``"dead"`` or None if unknown."""
        member = self._parts.report.members.get(peer_id)
        return None if member is None else member.state.value

    def pushed_back(self, peer_id: str, now: float) -> bool:
        """Whether ``peer_id`` asked us to back off and that time has not passed."""
        est = self._parts.gossip.estimates.get(peer_id)
        until = None if est is None else est.pushback_until
        return until is not None and until > now

    def metrics(self) -> dict[str, float]:
        """Flat counters and gauges (names are stable: the runtime exports them)."""
        return self._parts.report.metrics()

    def mesh_state(self, now: float) -> dict[str, object]:
        """JSON-able view of this node's mesh, for ``GET /mesh``."""
        return self._parts.report.mesh_state(now)
