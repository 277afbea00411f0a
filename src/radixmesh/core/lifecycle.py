"""The life of a request that entered this node: route, try peers, fall back, finish.

Theory of operation
-------------------
One :class:`Flight` per client request in flight at its entry node, keyed by the shell's
request id. The shells (runtime, simulator) only report what happened and carry out the
actions; every decision — which peer next, when to give up on peers, the route label, where
the answer continues after a peer died mid-stream — is taken here, once::

                    RequestArrived
                          │ route: ranked candidates (self listed unless it lacks the adapter)
                          ▼
      ┌────────────── next try ◀────────────── ForwardRefused / ForwardFailed (not accepted)
      │ peer, attempts < max          │ self, or attempts used up
      ▼ Forward                       ▼ ExecuteLocally(route local | fallback)
    OFFERED ── ForwardAccepted ──▶ STREAMING ── ForwardFailed(tokens_so_far) ──▶ LOCAL
      │                              │            ExecuteLocally(fallback, resume_after)
      └──────── RequestDone ─────────┴──────────── RequestDone ──────────────────┘  (gone)
    any state ── RequestCancelled ──▶ Abort(peer | local)                          (gone)

Rules:
* after a refusal or a failure the remaining candidates are ranked again from the node's
  current view (the shell's ``fresh`` ranking, peers already tried left out): a burst that
  arrived while this node's queue was empty must not all fall back here once that queue is
  long — the next try goes to whoever is best *now*;
* a peer is *tried* when it is sent the request, or when it has no known address (counted
  as ``forwards_unknown_peer``, never suspected: membership does not know it); after
  ``ForwardConfig.max_peer_attempts`` tries the request runs locally;
* the route label is ``local`` / ``forwarded`` for a first choice and ``fallback`` once any
  try was refused, failed or unknown;
* once a peer has *accepted*, a failure is never retried on another peer: the answer
  continues here after the tokens the client already has (the peer may have spent a queue
  wait on it already; a second forward could double that);
* a node that is full (``AdmissionConfig``) skips itself: every ranked peer may be tried,
  within the same limit, and when none takes it the request is rejected (``RejectRequest``,
  the client is told when to retry) — never queued without bound; a *leaving* node is full
  for everything new, but while its remaining grace outlasts the request's predicted latency
  (and its admission bounds have room) it serves what no peer took, rather than reject it;
* events for a request or peer the flight is not waiting for are *stale* (a timeout that
  raced a reply): ``is_current`` says so and the node ignores them.

Three things the router needs are kept here, where the tries are made: the forwards in flight
to each peer, numbered in the order they were sent (``forwards_since``: the node adds those
a peer's last load report cannot have counted to its queue), their prompts' blocks
(``blocks_at``: a peer computing a prefix for one of our requests holds it for the next one,
before its gossip can say so), and, per request served, the
router's placement tag of the candidate that served it (``LifecycleCounters.placements``:
hits, first copies, deliberate replicas, second cold copies), counted when a peer accepted
it or it started locally.

Illegal transitions are the shell's bugs only if they name the current try in a state where
that event cannot happen (e.g. ``ForwardAccepted`` while executing locally): they are counted
as stale too, never raised — a shell driven by a network cannot always order its callbacks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from radixmesh.core.config import ForwardConfig
from radixmesh.core.cost_model import Candidate
from radixmesh.core.events import (
    Abort,
    ExecuteLocally,
    Forward,
    RejectRequest,
    RequestAction,
    RequestArrived,
)
from radixmesh.core.load_estimates import QueuedBlocks

AddressOf = Callable[[str], str | None]  # peer id -> address (None: not a known member)


class Stage(Enum):
    OFFERED = "offered"  # sent to a peer, no reply yet
    STREAMING = "streaming"  # the peer accepted it and is executing it
    LOCAL = "local"  # executing on this node's engine


# event name -> the stages in which it may arrive for the current try
_LEGAL: dict[str, frozenset[Stage]] = {
    "accepted": frozenset({Stage.OFFERED}),
    "refused": frozenset({Stage.OFFERED}),
    "failed": frozenset({Stage.OFFERED, Stage.STREAMING}),
    "done": frozenset(Stage),  # a peer's answer implies it accepted (it may overtake that)
}


@dataclass(slots=True)
class Flight:
    """One request's state at its entry node."""

    arrived: RequestArrived  # what the request is (its id, hashes; to rank it again)
    candidates: list[Candidate]
    self_expected: int  # the router's estimate of this node's cached prefix
    stage: Stage = Stage.LOCAL
    peer: str | None = None  # the peer of the current try (None: local)
    next_index: int = 0  # into candidates
    peer_tries: int = 0
    fell_back: bool = False  # a try was refused, failed or unknown
    route: str = "local"
    full_for_s: float | None = None  # this node is full: its queue's wait (None: it has room)
    # Full (leaving), yet it may run here if no peer takes it: a draining node whose grace
    # outlasts the request's predicted latency serves it rather than answer 429.
    last_resort_local: bool = False
    full_by_quota: bool = False  # full for this request's tenant only (core/quotas.py)
    tried: set[str] = field(default_factory=set)  # peers already tried (never again)
    choice: Candidate | None = None  # the candidate of the current try (self: local)

    @property
    def rid(self) -> int:
        return self.arrived.rid

    def label(self, first: str) -> str:
        return "fallback" if self.fell_back else first


@dataclass(slots=True)
class LifecycleCounters:
    unknown_peer: int = 0
    stale: int = 0
    routes: dict[str, int] = field(default_factory=dict)  # route label at completion
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0
    placements: dict[str, int] = field(default_factory=dict)  # router tag of who served it


class Lifecycle:
    """The flights of one entry node and the transition rules above."""

    def __init__(
        self, config: ForwardConfig, address_of: AddressOf, min_retry_after_s: float = 1.0
    ) -> None:
        self._config = config
        self._min_retry_after_s = min_retry_after_s
        self._address_of = address_of
        self._flights: dict[int, Flight] = {}
        self.counters = LifecycleCounters()
        self._sent = 0  # forwards sent so far (their sequence numbers)
        self._at_peer: dict[str, dict[int, int]] = {}  # peer -> rid -> sequence number
        self._blocks_at: dict[str, QueuedBlocks] = {}  # peer -> blocks of those forwards

    @property
    def forwards_sent(self) -> int:
        """Forwards sent so far: the sequence number of the latest."""
        return self._sent

    def forwards_since(self, peer: str, seq: int) -> int:
        """Forwards to ``peer`` still in flight (offered or streaming) sent after ``seq``."""
        at = self._at_peer.get(peer)
        return 0 if not at else sum(1 for s in at.values() if s > seq)

    def blocks_at(self, peer: str, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (from the first) a forward in flight to ``peer`` has."""
        blocks = self._blocks_at.get(peer)
        return 0 if blocks is None else blocks.covered(hashes)

    def peers_with_blocks(self) -> list[str]:
        """The peers that forwards in flight were sent to."""
        return list(self._blocks_at)

    def release(self, rid: int) -> None:
        """The current try of ``rid`` at a peer is over (refused, failed before it was
        accepted): it no longer counts there, before the request is ranked again."""
        flight = self._flights.get(rid)
        if flight is not None:
            self._untrack(flight)

    def __len__(self) -> int:
        return len(self._flights)

    def get(self, rid: int) -> Flight | None:
        return self._flights.get(rid)

    # ---------------------------------------------------------------- transitions
    def start(
        self,
        event: RequestArrived,
        candidates: list[Candidate],
        full_for_s: float | None = None,
        last_resort_local: bool = False,
        full_by_quota: bool = False,
    ) -> list[RequestAction]:
        """A new request; ``full_for_s``: this node is full, its queue holds that much work;
        ``last_resort_local``: full, but it runs here rather than be rejected when every peer
        tried refused it (a leaving node within its grace); ``full_by_quota``: full for its
        tenant only (core/quotas.py: a rejection says so)."""
        if event.rid in self._flights:
            raise ValueError(f"request id {event.rid} is already in flight")  # a shell bug
        expected = next(
            (c.expected_cached_tokens for c in candidates if c.is_self), event.local_cached
        )
        flight = Flight(event, candidates, expected, full_for_s=full_for_s,
                        last_resort_local=last_resort_local, full_by_quota=full_by_quota)
        self._flights[event.rid] = flight
        return [self._next_try(flight)]

    def is_current(self, rid: int, peer: str | None, what: str) -> bool:
        """Whether an event ``what`` about ``peer`` is for ``rid``'s current try (else stale)."""
        flight = self._flights.get(rid)
        ok = flight is not None and flight.peer == peer and flight.stage in _LEGAL[what]
        if not ok:
            self.counters.stale += 1
        return ok

    def accepted(self, rid: int) -> None:
        flight = self._flights[rid]
        flight.stage = Stage.STREAMING
        self._placed(flight)

    def refused(self, rid: int, fresh: list[Candidate] | None = None) -> list[RequestAction]:
        """The current peer answered busy; ``fresh``: a new ranking to continue from."""
        flight = self._flights[rid]
        flight.fell_back = True
        self._rerank(flight, fresh)
        return [self._next_try(flight)]

    def failed(
        self, rid: int, tokens_so_far: int, fresh: list[Candidate] | None = None
    ) -> list[RequestAction]:
        flight = self._flights[rid]
        flight.fell_back = True
        if flight.stage is Stage.STREAMING:  # accepted: continue here, never another peer
            return [self._local(flight, max(tokens_so_far, 0))]
        self._rerank(flight, fresh)
        return [self._next_try(flight)]

    @staticmethod
    def _rerank(flight: Flight, fresh: list[Candidate] | None) -> None:
        if fresh is None:
            return
        flight.candidates = [c for c in fresh if c.is_self or c.node_id not in flight.tried]
        flight.next_index = 0
        flight.self_expected = next(
            (c.expected_cached_tokens for c in fresh if c.is_self), flight.self_expected
        )

    def done(self, rid: int, error: str | None) -> Flight:
        flight = self._flights.pop(rid)
        self._untrack(flight)
        if error is not None:
            self.counters.failed += 1
        routes = self.counters.routes
        routes[flight.route] = routes.get(flight.route, 0) + 1
        return flight

    def cancel(self, rid: int) -> list[RequestAction]:
        flight = self._flights.pop(rid, None)
        if flight is None:
            self.counters.stale += 1
            return []
        self._untrack(flight)
        self.counters.cancelled += 1
        return [Abort(rid, flight.peer)]

    # ---------------------------------------------------------------- decisions
    def _next_try(self, flight: Flight) -> RequestAction:
        cands = flight.candidates
        while flight.next_index < len(cands):
            cand = cands[flight.next_index]
            flight.next_index += 1
            if cand.is_self and flight.full_for_s is not None:
                continue  # no room here: look further down the ranking
            if cand.is_self or flight.peer_tries >= self._config.max_peer_attempts:
                break
            flight.peer_tries += 1
            flight.tried.add(cand.node_id)
            address = self._address_of(cand.node_id)
            if address is None:
                self.counters.unknown_peer += 1
                flight.fell_back = True
                continue
            return self._forward(flight, cand, address)
        if flight.full_for_s is not None and not flight.last_resort_local:
            return self._reject(flight, flight.full_by_quota)
        if not any(c.is_self for c in cands):  # not runnable here (an adapter it lacks)
            return self._reject(flight, False)
        return self._local(flight, 0)

    def _reject(self, flight: Flight, quota: bool) -> RejectRequest:
        self._untrack(flight)
        del self._flights[flight.rid]
        self.counters.rejected += 1
        retry = max(flight.full_for_s or 0.0, self._min_retry_after_s)
        return RejectRequest(flight.rid, retry, quota)

    def _forward(self, flight: Flight, cand: Candidate, address: str) -> Forward:
        self._untrack(flight)
        flight.stage, flight.peer, flight.choice = Stage.OFFERED, cand.node_id, cand
        self._sent += 1
        self._at_peer.setdefault(cand.node_id, {})[flight.rid] = self._sent
        blocks = self._blocks_at.get(cand.node_id)
        if blocks is None:
            blocks = self._blocks_at[cand.node_id] = QueuedBlocks(1)
        blocks.add(flight.arrived.hashes)
        flight.route = flight.label("forwarded")
        return Forward(
            flight.rid, cand.node_id, address, cand.beat_s, cand.expected_cached_tokens,
            flight.route, _tag(cand), cand.ttft_s,
        )

    def _local(self, flight: Flight, resume_after: int) -> ExecuteLocally:
        self._untrack(flight)
        flight.stage, flight.peer = Stage.LOCAL, None
        flight.choice = next((c for c in flight.candidates if c.is_self), None)
        if resume_after == 0:  # (a resumed answer was placed when the peer accepted it)
            self._placed(flight)
        flight.route = flight.label("local")
        return ExecuteLocally(flight.rid, flight.route, flight.self_expected, resume_after,
                              _tag(flight.choice),
                              None if flight.choice is None else flight.choice.ttft_s)

    def _untrack(self, flight: Flight) -> None:
        """The flight's current try at a peer is over (or never was; idempotent)."""
        if flight.peer is None:
            return
        at = self._at_peer.get(flight.peer)
        if at is None or at.pop(flight.rid, None) is None:
            return
        if at:
            self._blocks_at[flight.peer].remove(flight.arrived.hashes)
        else:  # its last forward in flight there: no blocks left either
            del self._at_peer[flight.peer]
            del self._blocks_at[flight.peer]

    def _placed(self, flight: Flight) -> None:
        tag = None if flight.choice is None else flight.choice.placement
        if tag is not None:
            placements = self.counters.placements
            placements[tag.value] = placements.get(tag.value, 0) + 1


def _tag(choice: Candidate | None) -> str | None:
    """The placement tag of a choice, as the actions carry it (None: nothing placed)."""
    return None if choice is None or choice.placement is None else choice.placement.value
